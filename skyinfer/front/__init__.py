"""The front process itself (``skyinfer serve``): ``app`` builds its aiohttp application from the
request path (``skyinfer.serving``), the admin side (``skyinfer.admin``), weight sync
(``skyinfer.weights``) and the fleet (``skyinfer.fleet``); ``service`` runs it (engines started,
signals, front workers, shutdown); ``bringup`` brings each engine process to the fleet before it
serves; ``cpu_support`` decides at start what a CPU engine can run. Runs in the front process only."""
