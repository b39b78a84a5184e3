-- Schema 2 → 3: the base's block energies, for plans ranked by rank_by: delta_over_sqrt_base.
-- Layouts written before stay NULL until a pass over that base fills them (flows/common.run_index).
ALTER TABLE IF EXISTS blocks ADD COLUMN IF NOT EXISTS base_sq DOUBLE;
UPDATE catalog_meta SET value = '3' WHERE key = 'schema_version';
