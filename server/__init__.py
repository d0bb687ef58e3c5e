"""localserve's daemon: engine, models, quantization and (later) the HTTP API."""
