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

-- Plans as layer tasks load them, on any machine: record and access set, by plan key.
CREATE TABLE IF NOT EXISTS saved_plans (
    plan_key     VARCHAR PRIMARY KEY,
    plan_digest  VARCHAR NOT NULL,
    record       BLOB NOT NULL,
    access       BLOB NOT NULL,
    created_at   TIMESTAMP NOT NULL DEFAULT current_timestamp
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

-- Who is indexing what: a client claims the (base, expert, block size) triples it is about to
-- index, so that clients starting at once index each expert once; the others wait for its
-- stat_sets rows. A claim whose heartbeat stopped (its process died) is taken over.
CREATE TABLE IF NOT EXISTS index_claims (
    base_fp       VARCHAR NOT NULL,
    expert_fp     VARCHAR NOT NULL,
    block_size    BIGINT NOT NULL,
    owner         VARCHAR NOT NULL,
    claimed_at    TIMESTAMP NOT NULL,
    heartbeat_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (base_fp, expert_fp, block_size)
);

-- Every trial of a merge search (`mergepipe search`): the candidate, what its budgeted merge
-- read, and its score; the final merges of the best trials at the final budget are rows too.
CREATE TABLE IF NOT EXISTS search_trials (
    search             VARCHAR NOT NULL,
    trial              INTEGER NOT NULL,
    final              BOOLEAN NOT NULL,
    state              VARCHAR NOT NULL,
    params_json        VARCHAR NOT NULL,
    config_yaml        VARCHAR NOT NULL,
    plan_key           VARCHAR,
    budget             VARCHAR NOT NULL,
    budget_bytes       BIGINT,
    expert_bytes_read  BIGINT,
    input_bytes_read   BIGINT,
    cache_bytes        BIGINT,
    error_bound        DOUBLE,
    score              DOUBLE,
    metrics_json       VARCHAR,
    error              VARCHAR,
    merge_seconds      DOUBLE,
    eval_seconds       DOUBLE,
    merge_digest       VARCHAR,
    worker             VARCHAR,
    finished_at        TIMESTAMP NOT NULL,
    PRIMARY KEY (search, trial, final)
);

-- Calibrations of a base (`mergepipe calibrate`): the base run over a set of texts, keyed by the
-- base's fingerprint and the texts' digest. One serves every expert and every later merge of
-- that base, on any machine sharing the catalog.
CREATE TABLE IF NOT EXISTS calibrations (
    base_fp      VARCHAR NOT NULL,
    data_digest  VARCHAR NOT NULL,
    data_uri     VARCHAR NOT NULL,
    texts        INTEGER NOT NULL,
    tokens       BIGINT NOT NULL,
    max_length   INTEGER NOT NULL,
    device       VARCHAR NOT NULL,
    seconds      DOUBLE NOT NULL,
    created_at   TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (base_fp, data_digest)
);

-- Per base tensor a calibration reached: the input channels' second moments of the linear
-- layer that uses it, or the token frequencies of the embedding that it is.
CREATE TABLE IF NOT EXISTS calibration_weights (
    base_fp      VARCHAR NOT NULL,
    data_digest  VARCHAR NOT NULL,
    tensor       VARCHAR NOT NULL,
    kind         VARCHAR NOT NULL,  -- input | token | output
    n            BIGINT NOT NULL,
    weights      BLOB NOT NULL,     -- n float64, little-endian
    PRIMARY KEY (base_fp, data_digest, tensor, kind)
);

-- Per (expert, block) of a tensor a calibration reached: the delta block's activation-weighted
-- energy. An activation_sets row is written with them, as stat_sets is with block_stats.
CREATE TABLE IF NOT EXISTS activation_stats (
    base_fp      VARCHAR NOT NULL,
    expert_fp    VARCHAR NOT NULL,
    block_size   BIGINT NOT NULL,
    data_digest  VARCHAR NOT NULL,
    tensor       VARCHAR NOT NULL,
    block        INTEGER NOT NULL,
    act_sq       DOUBLE NOT NULL
);

CREATE TABLE IF NOT EXISTS activation_sets (
    base_fp      VARCHAR NOT NULL,
    expert_fp    VARCHAR NOT NULL,
    block_size   BIGINT NOT NULL,
    data_digest  VARCHAR NOT NULL,
    computed_at  TIMESTAMP NOT NULL DEFAULT current_timestamp,
    PRIMARY KEY (base_fp, expert_fp, block_size, data_digest)
);
