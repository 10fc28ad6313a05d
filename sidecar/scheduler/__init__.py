"""Two-lane token-budget scheduler: packs queued sequences into engine steps, one thread per engine."""

from sidecar.scheduler.scheduler import *  # noqa: F401,F403
from sidecar.scheduler.scheduler import DEADLINE_SLACK_S  # noqa: F401
