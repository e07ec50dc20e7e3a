"""The HTTP edge that the router and the workers share, torch-free and framework-light: the API
key, strict JSON bodies, OpenAI's error shape, request ids, the client-gone watch, and
uvicorn's protocol with bounded headers, bodies and connections.
"""
