"""The HTTP door: the OpenAI and TEI embedding APIs as a thin ASGI front end over the sidecar's one Gateway."""
