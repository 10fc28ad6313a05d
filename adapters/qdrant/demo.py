"""The Qdrant part of `fern demo`: ingest a small corpus into local-mode Qdrant and run hybrid searches."""

from __future__ import annotations

from qdrant_client import models

from adapters.qdrant.client import FernQdrantClient
from sidecar.client import FernClient

COLLECTION = "fern-demo"
CORPUS = [
    {"id": "mechanic", "topic": "cars",
     "text": "Our mechanics fix cars: brakes, engines, tyres and oil changes while you wait."},
    {"id": "dealer", "topic": "cars",
     "text": "Used car dealer: financing available on every vehicle on the lot."},
    {"id": "gala", "topic": "events",
     "text": "The Automobile Club gala dinner features a string quartet and a three-course menu."},
    {"id": "bikeshop", "topic": "bikes",
     "text": "The bike shop fixes flat tyres, snapped chains and squeaky brakes."},
    {"id": "bread", "topic": "food",
     "text": "Knead the dough, let it rise overnight and bake the loaf at 230 degrees."},
    {"id": "espresso", "topic": "food",
     "text": "Espresso is brewed by forcing hot water through finely ground coffee."},
    {"id": "tides", "topic": "science",
     "text": "Tides are caused by the gravitational pull of the moon on the oceans."},
    {"id": "lists", "topic": "code",
     "text": "Python lists grow dynamically; appending is amortized constant time."},
    {"id": "polls", "topic": "civics",
     "text": "Polling stations open at seven and close at ten on election day."},
]
QUERIES = ["automobile repair", "how does the moon move the sea"]


def run(target: str) -> None:
    """Ingest CORPUS through the sidecar at `target` into an in-memory collection and search it."""
    with FernClient(target) as fern:
        fern.wait_ready()
        client = FernQdrantClient(":memory:", fern=fern)
        layout = client.setup_collection(COLLECTION)
        print(f"Qdrant (local mode, in memory): collection {COLLECTION!r}, model "
              f"{layout.model!r}, vectors {layout.dense!r} (dense) + {layout.sparse!r} (sparse, IDF)")
        print(client.ingest(COLLECTION, CORPUS, text="text", id="id", progress=False))
        for query in QUERIES:
            print(f"\nsearch {query!r}")
            for label, hybrid in (("dense ", False), ("hybrid", True)):
                hits = client.search(COLLECTION, query, k=3, hybrid=hybrid)
                shown = ", ".join(f"{hit.payload['id']} ({hit.score:.3f})" for hit in hits)
                print(f"  {label}: {shown}")
        cars = models.Filter(must=[models.FieldCondition(key="topic",
                                                         match=models.MatchValue(value="cars"))])
        hits = client.search(COLLECTION, "automobile repair", k=3, filter=cars)
        print("\nhybrid, filter topic=cars: " + ", ".join(hit.payload["id"] for hit in hits))
        doc = models.Document(text="a cup of coffee", model=f"fern/{layout.model}")
        top = client.query_points(COLLECTION, query=doc, using=layout.dense, limit=1).points[0]
        print(f"query_points(Document({doc.text!r}, model={doc.model!r})): {top.payload['text']}")
        client.close()
