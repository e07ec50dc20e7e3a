"""Model files: a name (directory, hub id, GGUF file) resolved to one local directory, its
`config.json` read into a `ModelConfig`, its safetensors weights read tensor by tensor.
"""
