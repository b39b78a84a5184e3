"""Prefect flows that compose the tasks (index_family, plan and merge, replay, budget_sweep,
merge_stages), where they run (in process or as flow runs; threads or Dask), the deployments and
the artifacts."""
