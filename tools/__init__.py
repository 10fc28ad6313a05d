"""Developer tools of the source tree: probes, device-run scripts, protocol checks."""
