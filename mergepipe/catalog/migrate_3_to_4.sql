-- Schema 3 → 4: a display name per model location. Rows from before take their location's last
-- part, or its last two parts, or the whole location: the shortest that no other location shares.
CREATE TABLE IF NOT EXISTS models (  -- as schema 3 had it, so that the steps below always apply
    model_fp        VARCHAR PRIMARY KEY,
    uri             VARCHAR NOT NULL,
    content_sha256  VARCHAR,
    n_tensors       INTEGER NOT NULL,
    tensor_bytes    BIGINT NOT NULL,
    registered_at   TIMESTAMP NOT NULL DEFAULT current_timestamp
);
ALTER TABLE models ADD COLUMN IF NOT EXISTS name VARCHAR;
UPDATE models SET name = named.name
FROM (
    WITH locations AS (
        SELECT DISTINCT uri,
               regexp_extract(rtrim(uri, '/'), '[^/]+$') AS one,
               regexp_extract(rtrim(uri, '/'), '[^/]+/[^/]+$') AS two
        FROM models
    )
    SELECT uri,
           CASE WHEN count(*) OVER (PARTITION BY one) = 1 AND one <> '' THEN one
                WHEN count(*) OVER (PARTITION BY two) = 1 AND two <> '' THEN two
                ELSE uri END AS name
    FROM locations
) AS named
WHERE models.uri = named.uri AND models.name IS NULL;
UPDATE catalog_meta SET value = '4' WHERE key = 'schema_version';
