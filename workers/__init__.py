"""Worker side of llama-gateway: provisioning llama-server, supervision, probes, GPU telemetry."""
