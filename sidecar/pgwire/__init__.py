"""The sidecar's PostgreSQL-protocol endpoint: `SELECT embed('text')` over the wire, for dblink and libpq clients.

Why a Postgres endpoint: `dblink`, shipped with PostgreSQL and offered by managed
services, can call any server that speaks the Postgres protocol, so a plain SQL
function (`fern.embed`, adapters/postgres/embed_function.py) can reach the GPU with no
untrusted language. The endpoint answers the protocol's startup handshake, TLS
(SSLRequest), SCRAM-SHA-256 password authentication through scramp (the secret is the
sidecar's token), CancelRequest, and the simple and extended query protocols
(parameters $1.. bound as text) for the grammar of `sidecar.pgwire.grammar`; every
embedding goes through `Gateway.embed`, so SQL callers get the gRPC callers'
validation, messages and scheduler lanes. Vectors come back as pgvector text
(`[0.1,-0.2,...]`) in a text column, so `::vector` or dblink's `AS r(v vector)` reads them.

Not a library: the well-kept Python options (buenavista: a threaded socketserver proxy;
riffq: a Rust server with its own loop) do not run inside the sidecar's asyncio loop, and
what is needed here is a few messages. The package reads in layers: `lexer` and
`grammar` (the SQL), `framing` (pure message builders and bounded reads), `auth`
(SCRAM and the failed-authentication limit), `session` (one connection's queries) and
`server` (listening, TLS, startup, limits).
"""
from sidecar.pgwire.auth import (AuthenticationFailed, AuthLimits, FailedAuthLimiter,
                                 ScramExchange, ScramVerifier)
from sidecar.pgwire.framing import (ProtocolError, data_row, error_response, parse_startup,
                                    vector_text)
from sidecar.pgwire.server import PgWireLimits, PgWireServer

__all__ = ["AuthLimits", "AuthenticationFailed", "FailedAuthLimiter", "PgWireLimits",
           "PgWireServer", "ProtocolError", "ScramExchange", "ScramVerifier", "data_row",
           "error_response", "parse_startup", "vector_text"]
