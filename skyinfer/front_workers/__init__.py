"""``skyinfer serve --front-workers N``: data-plane processes beside the front (docs/architecture.rst)."""
