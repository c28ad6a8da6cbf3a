"""Weight sync: rank layout, metadata checks, packing, and the front's orchestration."""
