-- One round of the greedy fill: walking the candidates in rank order after $after, take each
-- one that still fits in $remaining bytes. Candidates larger than $remaining can never fit
-- (the remainder only shrinks), so they are filtered out; the longest prefix of the rest whose
-- running total fits is taken, and the first one that does not fit ends the round.
WITH fits AS (
    SELECT rank, sum(bytes) OVER (ORDER BY rank ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cum
    FROM plan_candidates
    WHERE rank > $after AND bytes <= $remaining
)
SELECT coalesce(max(rank) FILTER (WHERE cum <= $remaining), $after) AS last_taken,
       coalesce(max(cum) FILTER (WHERE cum <= $remaining), 0) AS taken_bytes,
       min(rank) FILTER (WHERE cum > $remaining) AS first_skipped
FROM fits;
