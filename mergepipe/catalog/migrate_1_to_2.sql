-- Schema 1 → 2: model files may be objects (ETag, version id) rather than local files.
ALTER TABLE model_files ALTER COLUMN mtime_ns DROP NOT NULL;
ALTER TABLE model_files ALTER COLUMN ctime_ns DROP NOT NULL;
ALTER TABLE model_files ALTER COLUMN inode DROP NOT NULL;
ALTER TABLE model_files ADD COLUMN etag VARCHAR;
ALTER TABLE model_files ADD COLUMN version_id VARCHAR;
UPDATE catalog_meta SET value = '2' WHERE key = 'schema_version';
