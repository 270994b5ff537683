"""A trainer that found its rendezvous closed: recorded, never counted, and the rendezvous store made anew.

Plain torchrun's agent closes the rendezvous for good when it gives up (its workers failed more than --max-restarts
times, or an error of its own); `ddp_trainer.launch` does not (its rule 5). Every agent of that rendezvous id then
ends at once with torch's RendezvousClosedError, and so does every agent the kubelet restarts in place: without
help the job crash-loops on the closed rendezvous, never running the script again, and the user's real failure (the
agent that gave up, recorded and counted with its own class) is buried under failures that are only its echo.

So a trainer (an in-place restart or an ended pod) whose log ends with RendezvousClosedError, while no trainer of the
job has succeeded (a finishing run closes it too, and a released spare is spares.py's), is recorded with reason
RendezvousClosed, never counted and no incident (status.lastFailure keeps the failure that closed it), and the
current store pod is recorded (RendezvousReset: not a lost store) and deleted, once: create_missing recreates it
empty under the same name, the trainers' containers restart in place against it and run the script again. The next
failure of the script counts with its own class, so a crash loop of the user's code still ends at backoffLimit. A
Warning Event RendezvousReset says why.
"""

from __future__ import annotations

from ddp_operator import names
from ddp_operator.failure_class import rendezvous_closed
from ddp_operator.observed import PodState
from ddp_operator.plan.state import Pass
from ddp_operator.status import Event


def closed(ctx: Pass, message: str) -> bool:
    """Whether a trainer whose log ends with `message` ended on a closed rendezvous that the store's renewal can reopen
    (no trainer succeeded)."""
    return rendezvous_closed(message) and not any(q.succeeded for q in ctx.trainers if ctx.current(q))


def reopen(ctx: Pass, p: PodState, restart: int | None = None) -> None:
    """Record `p`'s end on the closed rendezvous (not counted, no incident) and renew the store once."""
    ctx.record(p, counted=False, reason=names.REASON_RDZV_CLOSED, restart=restart)
    stores = [s for s in ctx.observed.pods if s.role == names.ROLE_RDZV and s.group == ctx.group
              and not s.terminal and not s.deleting and not s.gone and not ctx.recorded(s)]
    for store in stores:
        ctx.record(store, counted=False, reason=names.REASON_RDZV_RESET)
        ctx.delete(store)
        ctx.extra_events.append(Event(
            "Warning", names.REASON_RDZV_RESET,
            f"pod {p.name}'s torchrun found the rendezvous closed (an agent that gave up closes it, after its workers "
            f"failed more than --max-restarts times); recreating the rendezvous store pod {store.name} so that the "
            f"trainers meet again (not counted: the failure that closed it was)"))
