"""What every worker shares: the HTTP app (OpenAI + native API) and the engine process."""
