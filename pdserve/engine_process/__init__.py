"""A worker's engine process: it builds the role's worker (engine and connector) and runs one loop,
the same for every role (`loop.EngineLoop.tick`: messages, the transfers' progress, a step),
sending each step's outputs to the front end (`server/`), which started it.
"""
