"""Tasks: thin wrappers over the stages' plain functions, declared with their retries, cache keys
and task-run names (Prefect is imported only when a flow runs with it), and the progress
reporting that tasks and flows share."""
