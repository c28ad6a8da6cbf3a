"""The request path: a client's OpenAI-compatible request to one engine and its answer back.
``proxy`` routes and relays (``body_bytes`` reads what routing needs off the body's bytes,
``stream_relay`` passes a streamed answer on), ``sessions`` keeps a session on its engine,
``leasing`` holds an engine for a request while admin calls run, ``draining`` ends requests at
shutdown, ``abandoning`` finishes what a caller who left started. Runs in the front process and in
each front worker process (``skyinfer.front_workers``)."""
