"""mergepipe's automations on a Prefect server (`mergepipe automations`): a crashed merge run is
scheduled again (it resumes from its staging), and a failed or crashed merge run is reported to
a webhook. Both match the runs of the merge and replay flows by the flows' names, so they cover
every deployment of them (the work pool's, `serve`'s, the nightly one)."""

from __future__ import annotations

from mergepipe.errors import MergepipeError
from mergepipe.flows.orchestration import in_process

MERGE_FLOWS = ["merge", "replay"]  # the flows that write an output
RETRY_NAME = "mergepipe: run a crashed merge again"
NOTIFY_NAME = "mergepipe: report a failed or crashed merge"
WEBHOOK_BLOCK = "mergepipe-alerts"
# A merge run runs this many times at most: a further start fails (refuse_endless_retries), and
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


def install_automations(webhook_url: str | None, retry_crashed: bool = True) -> list[str]:
    """Create mergepipe's automations (replacing earlier ones of the same names) on the Prefect
    server PREFECT_API_URL names. With `webhook_url`, a Webhook block `mergepipe-alerts`
    holds it (a secret in Prefect's store) and failed or crashed merge runs are POSTed there.
    Returns the names of the automations now in place."""
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import CallWebhook, ChangeFlowRunState

    wanted = []
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


def refuse_endless_retries() -> None:
    """Stop a merge run that has started MAX_RUNS times already: it failed (not crashed), so the
    retry automation lets it be, and the report says why."""
    if in_process():
        return
    from prefect.runtime import flow_run

    if (flow_run.run_count or 0) > MAX_RUNS:
        raise MergepipeError(
            f"this flow run has started {flow_run.run_count} times, crashing each time; not running it again "
            f"(after {MAX_RUNS} runs, a crashed merge is left for someone to look at)"
        )
