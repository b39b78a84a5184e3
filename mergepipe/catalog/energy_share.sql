-- sce's coefficients: c_k times expert k's share of the tensor's delta energy among the plan's
-- experts, sum_b ||delta_{k,b}||^2 / sum_j sum_b ||delta_{j,b}||^2 (1/K where the tensor's
-- deltas are all zero), the weight sce gives the expert, from the catalog alone. Non-finite
-- block energies are left out of the sums (such blocks rank first in planner.sql anyway).
-- Inputs: $base_fp, $block_size, and the registered table plan_coefficients_in (planner.sql);
-- the result has its columns and replaces it.
WITH energy AS (
    SELECT e.expert, e.expert_fp, e.tensor, e.coefficient,
           coalesce(sum(s.delta_sq) FILTER (WHERE isfinite(s.delta_sq)), 0) AS energy
    FROM plan_coefficients_in e
    LEFT JOIN block_stats s ON s.expert_fp = e.expert_fp AND s.tensor = e.tensor
                           AND s.base_fp = $base_fp AND s.block_size = $block_size
    GROUP BY ALL
)
SELECT expert, expert_fp, tensor,
       CASE WHEN sum(energy) OVER t > 0 THEN coefficient * energy / sum(energy) OVER t
            ELSE coefficient / count(*) OVER t END AS coefficient
FROM energy
WINDOW t AS (PARTITION BY tensor)
ORDER BY tensor, expert
