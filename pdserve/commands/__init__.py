"""The `pdserve` subcommands, one module each. Every module has `register(subparsers,
formatter)`, which adds its parser, and a `configure(args)` that checks the flags, builds the
settings and returns the run; `pdserve.cli.main` maps a `ValueError` from `configure` to one
`error:` line and exit code 2, before anything slow starts."""
