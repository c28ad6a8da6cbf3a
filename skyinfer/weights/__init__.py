"""Weight sync, the front's side: ``sync`` (the front door) over the fleet, the trainer's transfer
group, the push (live or staged), the checks, and the routes; peer catch-up (``catchup``)."""
