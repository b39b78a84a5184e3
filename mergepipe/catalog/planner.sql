-- Candidate (expert, block) pairs ranked for reading.
--   score(k, b) = |c_k| * ||delta_{k,b}||_F     the pair's term in the error bound
--   value(k, b) = score                          ($rank_by = 'delta')
--               = score / sqrt(||theta0_b||_F)   ($rank_by = 'delta_over_sqrt_base'; the base
--                 block's norm floored at 1e-30, and left out where it is not finite)
--               = |c_k| * sqrt(act_sq(k, b))     ($rank_by = 'activation': the delta block's energy
--                 weighted by calibration $calibration (activation_stats); a block of a tensor
--                 it did not reach keeps its data-free delta_sq)
--   out_sq(k, b) = c_k^2 * act_sq (or delta_sq): the output energy the pair adds, predicted
--   rank by value per byte, descending; ties broken by (expert position, tensor, block) so the
--   order is total and the plan deterministic.
-- Blocks whose delta is NaN or Inf (delta_sq = +inf) rank first, so no budget omits one quietly.
-- Blocks whose delta is zero everywhere (nnz_delta = 0) are not candidates: reading them
-- costs bytes and changes nothing. Nor, with $skip_zero (the operator multiplies each delta by
-- its coefficient), are pairs whose coefficient is 0, unless their delta is NaN or Inf.
-- A pair that costs no bytes of its own (a padded vocabulary's padding rows, made from rows
-- read once per tensor, which the plan counts apart) ranks first among the finite.
-- Inputs: $base_fp, $block_size, and the registered table
--   plan_coefficients_in(expert, expert_fp, tensor, coefficient): c_k per tensor (filters and
--   gradients in the config make it vary).
CREATE OR REPLACE TEMP TABLE plan_candidates AS
WITH cand AS (
    SELECT e.expert, s.tensor, s.block, b.layer, b.row_start, b.row_end, s.bytes, s.delta_sq, b.base_sq,
           -- A non-finite delta (stored as +inf) outranks everything, even with a zero coefficient.
           CASE WHEN isinf(s.delta_sq) THEN 'inf'::DOUBLE ELSE abs(e.coefficient) * sqrt(s.delta_sq) END AS score,
           e.coefficient * e.coefficient * coalesce(a.act_sq, s.delta_sq) AS out_sq
    FROM block_stats s
    JOIN plan_coefficients_in e ON e.expert_fp = s.expert_fp AND e.tensor = s.tensor
    JOIN blocks b ON b.base_fp = s.base_fp AND b.block_size = s.block_size AND b.tensor = s.tensor AND b.block = s.block
    LEFT JOIN activation_stats a
        ON $rank_by = 'activation' AND a.base_fp = s.base_fp AND a.expert_fp = s.expert_fp
       AND a.block_size = s.block_size AND a.data_digest = $calibration AND a.tensor = s.tensor AND a.block = s.block
    WHERE s.base_fp = $base_fp AND s.block_size = $block_size AND s.nnz_delta > 0
      AND NOT ($skip_zero AND e.coefficient = 0 AND NOT isinf(s.delta_sq))
), valued AS (
    SELECT *,
           CASE WHEN $rank_by = 'delta_over_sqrt_base' AND isfinite(base_sq)
                THEN score / sqrt(greatest(sqrt(base_sq), 1e-30))
                WHEN $rank_by = 'activation' AND NOT isinf(delta_sq) AND out_sq IS NOT NULL
                THEN sqrt(out_sq)
                ELSE score END AS value
    FROM cand
)
SELECT row_number() OVER w AS rank,
       expert, tensor, block, layer, row_start, row_end, bytes, delta_sq, score, value, out_sq,
       sum(bytes) OVER (w ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum_bytes,
       false AS selected
FROM valued
WINDOW w AS (ORDER BY CASE WHEN bytes = 0 THEN 'inf'::DOUBLE ELSE value / bytes END DESC, expert, tensor, block);
