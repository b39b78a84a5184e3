"""The only code that speaks SQL: the DuckDB catalog, its ingestion and the planner queries."""
