"""Development tools: small synthetic families for the demo, the tests and the benchmarks. No library module imports this package."""
