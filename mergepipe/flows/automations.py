"""mergepipe's automations on a Prefect server (`mergepipe automations`): a merge run whose
heartbeats stopped (its machine or process lost) is marked Crashed, a crashed merge run is
scheduled again (it resumes from its staging), and a failed or crashed merge run is reported to
a webhook. They match the runs of the merge and replay flows by the flows' names, so they cover
every deployment of them (the work pool's, `serve`'s, the nightly one). Also here: what a merge
run does first (begin_attempt)."""

from __future__ import annotations

from mergepipe.errors import BadInput, MergepipeError
from mergepipe.flows.orchestration import in_process

MERGE_FLOWS = ["merge", "replay"]  # the flows that write an output
RETRY_NAME = "mergepipe: run a crashed merge again"
NOTIFY_NAME = "mergepipe: report a failed or crashed merge"
LOST_NAME = "mergepipe: mark a silent merge run crashed"
# Flow runs send a heartbeat event this often (seconds; Prefect's minimum is 30): the
# deployments set it in the runs' environment, and `lost_after` must exceed it.
HEARTBEAT_SECONDS = 30
LOST_AFTER = 90  # seconds without a heartbeat before a running merge run is taken for lost
# A run's last heartbeat is followed by one of these; a lost run's by none.
_AFTER_HEARTBEAT = [
    "prefect.flow-run.heartbeat",
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
]
WEBHOOK_BLOCK = "mergepipe-alerts"
# A merge run runs this many times at most: a further start fails (begin_attempt), and
# a failed run is not scheduled again, so a run that crashes every time does not loop.
MAX_RUNS = 3

# What the webhook receives: the run, its state and the event (Prefect's Jinja template).
PAYLOAD = (
    '{"flow_run": "{{ flow_run.name }}", "flow_run_id": "{{ flow_run.id }}", '
    '"state": "{{ flow_run.state.name }}", "message": {{ flow_run.state.message | tojson }}, '
    '"parameters": {{ flow_run.parameters | tojson }}, "event": "{{ event.event }}"}'
)


def _trigger(events: list[str]):
    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        expect=set(events),
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": MERGE_FLOWS},
        posture=Posture.Reactive,
        threshold=1,
        within=0,
    )


def _silence_trigger(lost_after: float):
    """Fires for a merge run whose heartbeat is followed by no event at all for `lost_after`
    seconds: Prefect's pattern for runs whose process died without a word (SIGKILL, OOM, a
    machine gone), which nothing else ever moves out of Running."""
    from prefect.events.schemas.automations import EventTrigger, Posture

    return EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect=set(_AFTER_HEARTBEAT),
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": MERGE_FLOWS},
        for_each={"prefect.resource.id"},
        posture=Posture.Proactive,
        threshold=1,
        within=lost_after,
    )


def install_automations(
    webhook_url: str | None, retry_crashed: bool = True, lost_after: float = LOST_AFTER
) -> list[str]:
    """Create mergepipe's automations (replacing earlier ones of the same names) on the Prefect
    server PREFECT_API_URL names. A merge run silent for `lost_after` seconds after a heartbeat
    is marked Crashed. With `webhook_url`, a Webhook block `mergepipe-alerts` holds it (a secret
    in Prefect's store) and failed or crashed merge runs are POSTed there. Returns the names of
    the automations now in place."""
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import CallWebhook, ChangeFlowRunState

    if lost_after <= HEARTBEAT_SECONDS:
        raise BadInput(
            f"--lost-after {lost_after:g}: a run's heartbeats come every {HEARTBEAT_SECONDS} s, so a run "
            f"must be silent for longer than that before it is taken for lost"
        )
    wanted = [
        Automation(
            name=LOST_NAME,
            description=f"Marks a running merge run Crashed when {lost_after:g} s pass after a heartbeat "
            "with no further heartbeat or state change (its process or machine is gone).",
            trigger=_silence_trigger(lost_after),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"no heartbeat for {lost_after:g} s: the run's process or machine was lost",
                )
            ],
        )
    ]
    if retry_crashed:
        wanted.append(
            Automation(
                name=RETRY_NAME,
                description=f"Schedules a crashed merge run again (at most {MAX_RUNS} runs); it resumes "
                "the layer groups it finished from its staging.",
                trigger=_trigger(["prefect.flow-run.Crashed"]),
                actions=[
                    ChangeFlowRunState(
                        state=StateType.SCHEDULED,
                        name="AwaitingRetry",
                        message="scheduled again after a crash by the mergepipe automation",
                    )
                ],
            )
        )
    if webhook_url:
        block_id = Webhook(method="POST", url=webhook_url, allow_private_urls=True).save(WEBHOOK_BLOCK, overwrite=True)
        wanted.append(
            Automation(
                name=NOTIFY_NAME,
                description="POSTs a failed or crashed merge run to the mergepipe-alerts webhook.",
                trigger=_trigger(["prefect.flow-run.Failed", "prefect.flow-run.Crashed"]),
                actions=[CallWebhook(block_document_id=block_id, payload=PAYLOAD)],
            )
        )
    for automation in wanted:
        while True:  # an earlier install's, however many
            try:
                Automation.read(name=automation.name).delete()
            except ValueError:  # none (left) of that name
                break
        automation.create()
    return [a.name for a in wanted]


def begin_attempt() -> None:
    """What a merge (or replay) run does before anything else. Run again after a crash, it
    marks the task runs its earlier attempt left unfinished as Crashed (their process died with
    it), so none stays Running; and it stops a run that has started MAX_RUNS times already (it
    fails, not crashes, so the retry automation lets it be, and the report says why)."""
    if in_process():
        return
    from prefect.runtime import flow_run

    runs = flow_run.run_count or 0
    if runs <= 1:
        return
    _settle_earlier_attempt(flow_run.id)
    if runs > MAX_RUNS:
        raise MergepipeError(
            f"this flow run has started {runs} times, crashing each time; not running it again "
            f"(after {MAX_RUNS} runs, a crashed merge is left for someone to look at)"
        )


def _settle_earlier_attempt(flow_run_id: str) -> None:
    """Every task run of the flow run still Running or Pending is Crashed: called before this
    attempt starts a task, so they are all the earlier attempt's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        unfinished = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))
            ),
        )
        for task_run in unfinished:
            client.set_task_run_state(
                task_run.id, Crashed(message="its flow run's earlier attempt was lost"), force=True
            )
