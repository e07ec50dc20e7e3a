"""Text in and out: chat messages to prompt ids (`chat_template.py`), token ids back to text
with stop strings (`detokenizer.py`). Torch-free.
"""
