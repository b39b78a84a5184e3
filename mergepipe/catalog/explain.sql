-- Explain a plan: per layer and expert, bytes selected and the share of delta energy captured.
SELECT b.layer,
       e.expert,
       any_value(coalesce(m.name, m.uri)) AS name,
       sum(s.bytes) AS expert_bytes,
       coalesce(sum(s.bytes) FILTER (WHERE a.block IS NOT NULL), 0) AS selected_bytes,
       coalesce(sum(s.delta_sq) FILTER (WHERE isfinite(s.delta_sq)), 0) AS delta_energy,
       coalesce(sum(s.delta_sq) FILTER (WHERE a.block IS NOT NULL AND isfinite(s.delta_sq)), 0) AS captured_energy,
       -- blocks whose delta is NaN or Inf (allow_nonfinite): always read, not in the energies
       count(*) FILTER (WHERE NOT isfinite(s.delta_sq)) AS nonfinite_blocks
FROM block_stats s
JOIN blocks b USING (base_fp, block_size, tensor, block)
JOIN plan_experts e ON e.expert_fp = s.expert_fp AND e.plan_digest = $plan_digest
JOIN models m ON m.model_fp = e.expert_fp
LEFT JOIN access_sets a
       ON a.plan_digest = $plan_digest AND a.expert = e.expert AND a.tensor = s.tensor AND a.block = s.block
WHERE s.base_fp = $base_fp AND s.block_size = $block_size
GROUP BY b.layer, e.expert
ORDER BY b.layer, e.expert;
