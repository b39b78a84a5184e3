-- The error bound if the first $n candidates are read and the rest omitted:
--   sqrt( sum over blocks of ( sum over omitted experts of score )^2 )
-- Blocks are disjoint, so the omitted deltas of different blocks are orthogonal.
SELECT coalesce(sqrt(sum(s * s)), 0.0) AS bound
FROM (SELECT sum(score) AS s FROM plan_candidates WHERE rank > $n GROUP BY tensor, block);
