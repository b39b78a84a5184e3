"""Put this folder on PYTHONPATH to slow each layer group of a merge by
MERGEPIPE_TEST_GROUP_SECONDS and to append each merging process's pid to MERGEPIPE_TEST_PIDS:
a worker's flow-run process can then be found and killed mid-merge. With MERGEPIPE_TEST_HOLD set
to a path, each group also waits until that file exists: a test can hold a merge at its first
group (lease taken, nothing published) until it has seen what it waits for. Nothing happens unless
MERGEPIPE_TEST_GROUP_SECONDS is set; mergepipe is patched when it is first imported, so
processes that never import it (a Prefect worker) are left as they are."""

import os
import sys

if os.environ.get("MERGEPIPE_TEST_GROUP_SECONDS"):
    import importlib.abc
    import importlib.util
    import time

    TARGET = "mergepipe.tasks.merge"

    def _slowed(real):
        def merge_group(*args, **kwargs):
            with open(os.environ["MERGEPIPE_TEST_PIDS"], "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(float(os.environ["MERGEPIPE_TEST_GROUP_SECONDS"]))
            hold, deadline = os.environ.get("MERGEPIPE_TEST_HOLD"), time.monotonic() + 600
            while hold and not os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.2)
            return real(*args, **kwargs)

        return merge_group

    class _Patch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                module.merge_group = _slowed(module.merge_group)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patch())
