-- The catalog's views: in the DuckDB file itself; on a shared catalog, made as temporary views
-- by every connection (DuckDB SQL over the attached tables, so the database keeps none).

-- Everyday questions -------------------------------------------------------------------------

-- Delta energy per expert per layer (per indexed base and block size).
CREATE OR REPLACE VIEW delta_energy_by_layer AS
SELECT m.name AS expert, b.layer, s.block_size,
       sum(s.delta_sq) AS delta_energy,
       sqrt(sum(s.delta_sq)) AS delta_norm,
       sum(s.bytes) AS bytes,
       count(*) FILTER (WHERE s.nnz_delta > 0) AS changed_blocks,
       count(*) AS blocks,
       m.uri AS expert_uri
FROM block_stats s
JOIN stat_sets ss USING (base_fp, expert_fp, block_size)
JOIN blocks b USING (base_fp, block_size, tensor, block)
JOIN models m ON m.model_fp = s.expert_fp
GROUP BY ALL;

-- Which tensors does each expert change, and by how much.
CREATE OR REPLACE VIEW changed_tensors AS
SELECT m.name AS expert, s.tensor, b.layer, s.block_size,
       sqrt(sum(s.delta_sq)) AS delta_norm,
       max(s.max_abs_delta) AS max_abs_delta,
       sum(s.nnz_delta) AS changed_elements,
       sum(s.bytes) AS bytes,
       m.uri AS expert_uri
FROM block_stats s
JOIN stat_sets ss USING (base_fp, expert_fp, block_size)
JOIN blocks b USING (base_fp, block_size, tensor, block)
JOIN models m ON m.model_fp = s.expert_fp
GROUP BY ALL
HAVING sum(s.nnz_delta) > 0;

-- Every merge with its plan and realized bytes.
CREATE OR REPLACE VIEW merge_history AS
SELECT r.finished_at, r.kind, r.out_uri, r.merge_digest, p.merge_method, p.budget,
       (SELECT list(coalesce(m.name, m.uri) ORDER BY e.expert)
        FROM plan_experts e JOIN models m ON m.model_fp = e.expert_fp
        WHERE e.plan_digest = r.plan_digest) AS experts,
       r.expert_bytes_planned, r.expert_bytes_read, p.full_expert_bytes, p.error_bound, r.wall_seconds
FROM runs r JOIN plans p USING (plan_digest);
