"""The router: OpenAI front door that pairs a prefill and a decode worker per request.

Torch-free by design (a router pod needs no GPU image); it imports only `pdserve.protocol`.
"""
