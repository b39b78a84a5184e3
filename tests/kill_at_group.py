"""`mergepipe merge …`, SIGKILLed (with its whole process group, the ephemeral Prefect server
included) when the Nth layer group starts: a crash at a known point. Run as a script with
KILL_AT_GROUP=N and MERGEPIPE_WORKERS=1 (groups one after another)."""

import os
import signal
import sys

from mergepipe.tasks import merge_tasks

KILL_AT = int(os.environ["KILL_AT_GROUP"])
real = merge_tasks.merge_group
started = []


def merge_group(plan, layout, group, staging):
    started.append(group)
    if len(started) == KILL_AT:
        os.killpg(0, signal.SIGKILL)
    return real(plan, layout, group, staging)


merge_tasks.merge_group = merge_group

from mergepipe.cli import main  # noqa: E402

sys.argv = ["mergepipe", *sys.argv[1:]]
main()
