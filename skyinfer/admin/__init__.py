"""The admin side of the front: routes that act on every engine at once or report on the fleet.
``control`` (pause, resume, sleep, wake up), ``health`` (``/health``, ``/engines``), ``metrics``
(Prometheus), ``security`` (the API and admin keys), ``vllm_routes`` (vLLM's other routes, answered
for the fleet). Weight sync and LoRA adapters have a package of their own (``skyinfer.weights``).
Runs in the front process; ``metrics`` and ``security`` in front workers too."""
