"""The fleet: the engine processes the front supervises, and one model of their state. ``state``
(each engine's lifecycle, conditions and the fleet's intent: what a call may do in each state),
``registry`` (the engines, their records and the fleet's lock), ``routing`` (which engine serves a
request), ``engine_calls`` (the front's calls to an engine's socket), ``engine_process`` (one
engine's child process), ``engine_templates`` (forking engines from a warm template), ``spares``
(loaded standby engines), ``supervisor`` (starting, watching and restarting them),
``shm_leftovers`` (shared memory a dead engine left). Runs in the front process; imports nothing of
the request path, the admin side or weight sync."""
