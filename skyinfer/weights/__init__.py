"""Weight sync, the front's side: ``sync`` (the front door) over the fleet, the trainer's transfer
group, the push (live or staged), the checks, and the routes; peer catch-up (``catchup``); LoRA
adapters across the fleet (``adapters``). Runs in the front process: the engines' side of each
transport is in ``skyinfer.transfer`` and ``skyinfer.engine``."""
