"""The hang doctor: each rank's progress (heartbeat), stalls noticed while a run trains
(watch), and every rank's stack read and explained (stacks, diagnosis)."""

from relay.observe.doctor.heartbeat import Heartbeat, NoHeartbeat
from relay.observe.doctor.watch import examinations, examine, watching

__all__ = ["Heartbeat", "NoHeartbeat", "examinations", "examine", "watching"]
