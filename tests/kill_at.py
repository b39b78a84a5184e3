"""`mergepipe …` run as a script and SIGKILLed, with its whole process group, at a chosen point:
a crash at a known place. KILL_AT="module:function:N" kills on the Nth call of
module.function, before it runs; "module:function:N:after" kills when that call returns.

The function is replaced on its module, so the point must be called through the module's
attribute (a module-level call inside it, or `module.function(...)` from elsewhere)."""

import importlib
import os
import signal
import sys

module_name, function_name, nth, *when = os.environ["KILL_AT"].split(":")
module = importlib.import_module(module_name)
real = getattr(module, function_name)
calls = 0


def killing(*args, **kwargs):
    global calls
    calls += 1
    if calls == int(nth) and not when:
        os.killpg(0, signal.SIGKILL)
    result = real(*args, **kwargs)
    if calls == int(nth) and when == ["after"]:
        os.killpg(0, signal.SIGKILL)
    return result


setattr(module, function_name, killing)

from mergepipe.cli import main  # noqa: E402

sys.argv = ["mergepipe", *sys.argv[1:]]
main()
