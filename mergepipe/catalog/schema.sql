-- mergepipe catalog. One file serves many families and merges.
-- Statistics are keyed by model fingerprints (location + each file's size, and its mtime, ctime
-- and inode on local disk, or its ETag and version id in an object store) and block size;
-- a stat_sets row is written in the same transaction as its block_stats rows, and readers use
-- only block_stats that have one, so a half-ingested expert is never planned against.

CREATE TABLE IF NOT EXISTS models (
    model_fp        VARCHAR PRIMARY KEY,
    uri             VARCHAR NOT NULL,
    name            VARCHAR,  -- display name, unique per location; NULL only in rows older than schema 4
    content_sha256  VARCHAR,
    n_tensors       INTEGER NOT NULL,
    tensor_bytes    BIGINT NOT NULL,
    registered_at   TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS model_files (
    model_fp  VARCHAR NOT NULL,
    file      VARCHAR NOT NULL,
    size      BIGINT NOT NULL,
    mtime_ns  BIGINT,        -- local files
    ctime_ns  BIGINT,
    inode     BIGINT,
    header_bytes BIGINT NOT NULL,
    etag       VARCHAR,      -- objects
    version_id VARCHAR,
    PRIMARY KEY (model_fp, file)
);

CREATE TABLE IF NOT EXISTS tensors (
    model_fp    VARCHAR NOT NULL,
    name        VARCHAR NOT NULL,
    file        VARCHAR NOT NULL,
    dtype       VARCHAR NOT NULL,
    shape       BIGINT[] NOT NULL,
    byte_start  BIGINT NOT NULL,
    byte_end    BIGINT NOT NULL,
    layer       VARCHAR NOT NULL,
    PRIMARY KEY (model_fp, name)
);

CREATE TABLE IF NOT EXISTS stat_sets (
    base_fp     VARCHAR NOT NULL,
    expert_fp   VARCHAR NOT NULL,
    block_size  BIGINT NOT NULL,
    n_blocks    BIGINT NOT NULL,
    bytes       BIGINT NOT NULL,
    delta_sq    DOUBLE NOT NULL,
    indexed_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (base_fp, expert_fp, block_size)
);

-- The block layout of a base at a block size: runs of whole rows of each float tensor.
CREATE TABLE IF NOT EXISTS blocks (
    base_fp     VARCHAR NOT NULL,
    block_size  BIGINT NOT NULL,
    tensor      VARCHAR NOT NULL,
    block       INTEGER NOT NULL,
    layer       VARCHAR NOT NULL,
    row_start   BIGINT NOT NULL,
    row_end     BIGINT NOT NULL,
    base_bytes  BIGINT NOT NULL,
    base_sq     DOUBLE,  -- sum(b^2) in fp64; NULL where the layout predates schema 3
    PRIMARY KEY (base_fp, block_size, tensor, block)
);

-- Per (expert, block): bytes in the expert's own dtype, the delta's energy and reach.
CREATE TABLE IF NOT EXISTS block_stats (
    base_fp        VARCHAR NOT NULL,
    expert_fp      VARCHAR NOT NULL,
    block_size     BIGINT NOT NULL,
    tensor         VARCHAR NOT NULL,
    block          INTEGER NOT NULL,
    bytes          BIGINT NOT NULL,
    delta_sq       DOUBLE NOT NULL,
    max_abs_delta  DOUBLE NOT NULL,
    nnz_delta      BIGINT NOT NULL,
    content_hash   VARCHAR NOT NULL  -- XXH3-128 of the block's bytes (BLAKE2b-128 in rows indexed before
                                     -- schema 3); stored for inspection, compared by nothing
);

CREATE TABLE IF NOT EXISTS plans (
    plan_digest        VARCHAR PRIMARY KEY,
    base_fp            VARCHAR NOT NULL,
    block_size         BIGINT NOT NULL,
    merge_method       VARCHAR NOT NULL,
    budget             VARCHAR NOT NULL,
    budget_bytes       BIGINT NOT NULL,
    full_expert_bytes  BIGINT NOT NULL,
    planned_bytes      BIGINT NOT NULL,
    error_bound        DOUBLE NOT NULL,
    bound_guaranteed   BOOLEAN NOT NULL,
    n_pairs            BIGINT NOT NULL,
    created_at         TIMESTAMP NOT NULL DEFAULT current_timestamp
);

CREATE TABLE IF NOT EXISTS plan_experts (
    plan_digest    VARCHAR NOT NULL,
    expert         INTEGER NOT NULL,
    expert_fp      VARCHAR NOT NULL,
    coefficient    DOUBLE NOT NULL,  -- the largest |c_k| over tensors (filters and gradients vary it)
    planned_bytes  BIGINT NOT NULL,
    PRIMARY KEY (plan_digest, expert)
);

CREATE TABLE IF NOT EXISTS access_sets (
    plan_digest  VARCHAR NOT NULL,
    expert       INTEGER NOT NULL,
    tensor       VARCHAR NOT NULL,
    block        INTEGER NOT NULL,
    bytes        BIGINT NOT NULL,
    score        DOUBLE NOT NULL
);

CREATE TABLE IF NOT EXISTS runs (
    run_id         VARCHAR PRIMARY KEY,
    kind           VARCHAR NOT NULL,          -- merge | replay
    plan_digest    VARCHAR NOT NULL,
    merge_digest   VARCHAR NOT NULL,
    out_uri        VARCHAR NOT NULL,
    started_at     TIMESTAMP NOT NULL,
    finished_at    TIMESTAMP NOT NULL,
    wall_seconds   DOUBLE NOT NULL,
    expert_bytes_planned BIGINT NOT NULL,
    expert_bytes_read    BIGINT NOT NULL,
    base_bytes_read      BIGINT NOT NULL,
    header_bytes_read    BIGINT NOT NULL,
    output_bytes_written BIGINT NOT NULL,
    flow_run_id    VARCHAR
);

CREATE TABLE IF NOT EXISTS manifests (
    merge_digest  VARCHAR NOT NULL,
    out_uri       VARCHAR NOT NULL,
    manifest_json VARCHAR NOT NULL,
    created_at    TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (merge_digest, out_uri)
);

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
