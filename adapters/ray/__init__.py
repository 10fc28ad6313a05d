"""Ray Data adapter: embed a Dataset's text column through running sidecars or with Fern's engine in actors.

    from adapters.ray import FernEmbedder, embed_through

    ds.map_batches(embed_through("gpu-1:50051,gpu-2:50051"))          # tasks → sidecars
    ds.map_batches(FernEmbedder, concurrency=4, num_gpus=1, batch_size=4096)  # engine actors

Importing this package does not import torch: FernEmbedder loads the engine in the actor.
"""

from adapters.ray.batches import BatchError
from adapters.ray.engine import FernEmbedder
from adapters.ray.sidecars import SidecarEmbedder, embed_through

__all__ = ["BatchError", "FernEmbedder", "SidecarEmbedder", "embed_through"]
