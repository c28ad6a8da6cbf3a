"""The engine child process: one vLLM AsyncLLM behind a small aiohttp app on a Unix socket."""
