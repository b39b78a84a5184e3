-- What every table, view and column means: `mergepipe catalog schema` prints these comments.
-- Run after schema.sql and views.sql each time the catalog is opened for writing, so they follow the schema.
COMMENT ON TABLE models IS 'one row per model as found: its location and the fingerprint of its files';
COMMENT ON COLUMN models.model_fp IS 'fingerprint of the location and its files (changes when a file changes)';
COMMENT ON COLUMN models.uri IS 'the model folder or s3:// prefix';
COMMENT ON COLUMN models.name IS 'display name: the shortest trailing part of the location that no other location holds';
COMMENT ON COLUMN models.content_sha256 IS 'digest of the tensors (names, dtypes, shapes, bytes), wherever they live';
COMMENT ON COLUMN models.n_tensors IS 'number of tensors';
COMMENT ON COLUMN models.tensor_bytes IS 'bytes of all tensors';
COMMENT ON COLUMN models.registered_at IS 'when the model was first recorded';

COMMENT ON TABLE model_files IS 'the safetensors shards of each model and what identifies their content';
COMMENT ON COLUMN model_files.model_fp IS 'the model (models.model_fp)';
COMMENT ON COLUMN model_files.file IS 'shard name, relative to the model folder';
COMMENT ON COLUMN model_files.size IS 'bytes';
COMMENT ON COLUMN model_files.mtime_ns IS 'modification time (local files)';
COMMENT ON COLUMN model_files.ctime_ns IS 'status change time (local files)';
COMMENT ON COLUMN model_files.inode IS 'inode (local files)';
COMMENT ON COLUMN model_files.header_bytes IS 'bytes of the safetensors header, length prefix included';
COMMENT ON COLUMN model_files.etag IS 'ETag (objects)';
COMMENT ON COLUMN model_files.version_id IS 'version id (objects in a versioned bucket)';

COMMENT ON TABLE tensors IS 'every tensor of every model: where its bytes lie';
COMMENT ON COLUMN tensors.model_fp IS 'the model (models.model_fp)';
COMMENT ON COLUMN tensors.name IS 'tensor name';
COMMENT ON COLUMN tensors.file IS 'the shard holding it';
COMMENT ON COLUMN tensors.dtype IS 'safetensors dtype (BF16, F32, ...)';
COMMENT ON COLUMN tensors.shape IS 'shape';
COMMENT ON COLUMN tensors.byte_start IS 'first byte in the shard';
COMMENT ON COLUMN tensors.byte_end IS 'one past the last byte';
COMMENT ON COLUMN tensors.layer IS 'execution group: layer.NNNNN, embeddings, head or other';

COMMENT ON TABLE stat_sets IS 'one row per (base, expert, block size) whose statistics are complete';
COMMENT ON COLUMN stat_sets.base_fp IS 'the base (models.model_fp)';
COMMENT ON COLUMN stat_sets.expert_fp IS 'the expert (models.model_fp)';
COMMENT ON COLUMN stat_sets.block_size IS 'block size in bytes';
COMMENT ON COLUMN stat_sets.n_blocks IS 'blocks with statistics';
COMMENT ON COLUMN stat_sets.bytes IS 'expert bytes those blocks cover';
COMMENT ON COLUMN stat_sets.delta_sq IS 'sum of the squared delta over all blocks';
COMMENT ON COLUMN stat_sets.indexed_at IS 'when the statistics were recorded';

COMMENT ON TABLE blocks IS 'the block layout of a base at a block size: runs of whole rows of each float tensor';
COMMENT ON COLUMN blocks.base_fp IS 'the base (models.model_fp)';
COMMENT ON COLUMN blocks.block_size IS 'block size in bytes';
COMMENT ON COLUMN blocks.tensor IS 'tensor name';
COMMENT ON COLUMN blocks.block IS 'block number within the tensor';
COMMENT ON COLUMN blocks.layer IS 'execution group of the tensor';
COMMENT ON COLUMN blocks.row_start IS 'first row (dim 0)';
COMMENT ON COLUMN blocks.row_end IS 'one past the last row';
COMMENT ON COLUMN blocks.base_bytes IS 'bytes of the block in the base';
COMMENT ON COLUMN blocks.base_sq IS 'the base block''s energy, sum of b squared in fp64';

COMMENT ON TABLE block_stats IS 'per (expert, block): bytes, the delta''s energy and reach';
COMMENT ON COLUMN block_stats.base_fp IS 'the base (models.model_fp)';
COMMENT ON COLUMN block_stats.expert_fp IS 'the expert (models.model_fp)';
COMMENT ON COLUMN block_stats.block_size IS 'block size in bytes';
COMMENT ON COLUMN block_stats.tensor IS 'tensor name';
COMMENT ON COLUMN block_stats.block IS 'block number within the tensor';
COMMENT ON COLUMN block_stats.bytes IS 'bytes of the block in the expert''s own dtype (what reading it costs)';
COMMENT ON COLUMN block_stats.delta_sq IS 'sum of (expert - base) squared in fp64; +inf where the delta holds NaN or Inf';
COMMENT ON COLUMN block_stats.max_abs_delta IS 'largest |expert - base|';
COMMENT ON COLUMN block_stats.nnz_delta IS 'elements whose bits differ from the base''s (0: the block is never read)';
COMMENT ON COLUMN block_stats.content_hash IS 'XXH3-128 of the block''s bytes, for inspection';

COMMENT ON TABLE plans IS 'every plan made: its budget, what it reads and its error bound';
COMMENT ON COLUMN plans.plan_digest IS 'digest of (spec, input contents, block size, access set)';
COMMENT ON COLUMN plans.base_fp IS 'the base (models.model_fp)';
COMMENT ON COLUMN plans.block_size IS 'block size in bytes';
COMMENT ON COLUMN plans.merge_method IS 'the operator';
COMMENT ON COLUMN plans.budget IS 'the budget as given (25%, 512 MiB, max_error=...)';
COMMENT ON COLUMN plans.budget_bytes IS 'the budget in bytes';
COMMENT ON COLUMN plans.full_expert_bytes IS 'bytes of all experts (a full read)';
COMMENT ON COLUMN plans.planned_bytes IS 'expert bytes the plan reads';
COMMENT ON COLUMN plans.error_bound IS 'predicted bound on the Frobenius distance from the full-read merge';
COMMENT ON COLUMN plans.bound_guaranteed IS 'whether the bound is guaranteed (additive operators) or a heuristic';
COMMENT ON COLUMN plans.n_pairs IS '(expert, block) pairs read';
COMMENT ON COLUMN plans.created_at IS 'when the plan was made';

COMMENT ON TABLE plan_experts IS 'per plan and expert: its coefficient and planned bytes';
COMMENT ON COLUMN plan_experts.plan_digest IS 'the plan (plans.plan_digest)';
COMMENT ON COLUMN plan_experts.expert IS 'expert position in the config (0-based, the base not counted)';
COMMENT ON COLUMN plan_experts.expert_fp IS 'the expert (models.model_fp)';
COMMENT ON COLUMN plan_experts.coefficient IS 'the largest |c_k| over tensors (filters and gradients vary it)';
COMMENT ON COLUMN plan_experts.planned_bytes IS 'bytes the plan reads of this expert';

COMMENT ON TABLE access_sets IS 'the (expert, block) pairs each plan reads';
COMMENT ON COLUMN access_sets.plan_digest IS 'the plan (plans.plan_digest)';
COMMENT ON COLUMN access_sets.expert IS 'expert position (plan_experts.expert)';
COMMENT ON COLUMN access_sets.tensor IS 'tensor name';
COMMENT ON COLUMN access_sets.block IS 'block number';
COMMENT ON COLUMN access_sets.bytes IS 'bytes read';
COMMENT ON COLUMN access_sets.score IS '|c_k| times the block''s delta norm';

COMMENT ON TABLE runs IS 'every merge and replay that published, with what it read and wrote';
COMMENT ON COLUMN runs.run_id IS 'the Prefect flow run id, or plan digest and start time in process';
COMMENT ON COLUMN runs.kind IS 'merge or replay';
COMMENT ON COLUMN runs.plan_digest IS 'the plan executed';
COMMENT ON COLUMN runs.merge_digest IS 'digest of the manifest''s content: identifies the output';
COMMENT ON COLUMN runs.out_uri IS 'where the output was published';
COMMENT ON COLUMN runs.started_at IS 'start (UTC)';
COMMENT ON COLUMN runs.finished_at IS 'end (UTC)';
COMMENT ON COLUMN runs.wall_seconds IS 'wall time in seconds';
COMMENT ON COLUMN runs.expert_bytes_planned IS 'expert bytes the plan reads';
COMMENT ON COLUMN runs.expert_bytes_read IS 'expert bytes this run read (resumed groups not counted)';
COMMENT ON COLUMN runs.base_bytes_read IS 'base bytes read';
COMMENT ON COLUMN runs.header_bytes_read IS 'header bytes read';
COMMENT ON COLUMN runs.output_bytes_written IS 'output bytes written';
COMMENT ON COLUMN runs.flow_run_id IS 'the Prefect flow run, when there was one';

COMMENT ON TABLE saved_plans IS 'every plan as its layer tasks load it, from any machine';
COMMENT ON COLUMN saved_plans.plan_key IS 'the plan digest and its inputs'' locations (one plan over two copies of a family: two keys)';
COMMENT ON COLUMN saved_plans.plan_digest IS 'plans.plan_digest';
COMMENT ON COLUMN saved_plans.record IS 'the plan''s record: compact JSON, zstd-compressed after its 8-byte little-endian size';
COMMENT ON COLUMN saved_plans.access IS 'the access set: Parquet';
COMMENT ON COLUMN saved_plans.created_at IS 'when it was saved';
COMMENT ON TABLE manifests IS 'the manifest of every published output';
COMMENT ON COLUMN manifests.merge_digest IS 'the output''s digest';
COMMENT ON COLUMN manifests.out_uri IS 'where it was published';
COMMENT ON COLUMN manifests.manifest_json IS 'the manifest as published';
COMMENT ON COLUMN manifests.created_at IS 'when it was recorded';

COMMENT ON VIEW delta_energy_by_layer IS 'delta energy per expert per layer, for every indexed base and block size';
COMMENT ON COLUMN delta_energy_by_layer.expert IS 'the expert''s display name (models.name)';
COMMENT ON COLUMN delta_energy_by_layer.layer IS 'execution group';
COMMENT ON COLUMN delta_energy_by_layer.block_size IS 'block size in bytes';
COMMENT ON COLUMN delta_energy_by_layer.delta_energy IS 'sum of the squared delta';
COMMENT ON COLUMN delta_energy_by_layer.delta_norm IS 'its square root, the Frobenius norm';
COMMENT ON COLUMN delta_energy_by_layer.bytes IS 'expert bytes in the layer';
COMMENT ON COLUMN delta_energy_by_layer.changed_blocks IS 'blocks whose delta is not zero';
COMMENT ON COLUMN delta_energy_by_layer.blocks IS 'blocks in the layer';
COMMENT ON COLUMN delta_energy_by_layer.expert_uri IS 'the expert''s location';

COMMENT ON VIEW changed_tensors IS 'the tensors each expert changes, and by how much';
COMMENT ON COLUMN changed_tensors.expert IS 'the expert''s display name (models.name)';
COMMENT ON COLUMN changed_tensors.tensor IS 'tensor name';
COMMENT ON COLUMN changed_tensors.layer IS 'execution group';
COMMENT ON COLUMN changed_tensors.block_size IS 'block size in bytes';
COMMENT ON COLUMN changed_tensors.delta_norm IS 'Frobenius norm of the delta';
COMMENT ON COLUMN changed_tensors.max_abs_delta IS 'largest |delta|';
COMMENT ON COLUMN changed_tensors.changed_elements IS 'elements that differ from the base';
COMMENT ON COLUMN changed_tensors.bytes IS 'bytes of the tensor in the expert';
COMMENT ON COLUMN changed_tensors.expert_uri IS 'the expert''s location';

COMMENT ON VIEW merge_history IS 'every published merge and replay with its plan and realized bytes';
COMMENT ON COLUMN merge_history.finished_at IS 'end (UTC)';
COMMENT ON COLUMN merge_history.kind IS 'merge or replay';
COMMENT ON COLUMN merge_history.out_uri IS 'where the output was published';
COMMENT ON COLUMN merge_history.merge_digest IS 'the output''s digest';
COMMENT ON COLUMN merge_history.merge_method IS 'the operator';
COMMENT ON COLUMN merge_history.budget IS 'the budget as given';
COMMENT ON COLUMN merge_history.experts IS 'the experts'' display names, in config order';
COMMENT ON COLUMN merge_history.expert_bytes_planned IS 'expert bytes the plan reads';
COMMENT ON COLUMN merge_history.expert_bytes_read IS 'expert bytes this run read';
COMMENT ON COLUMN merge_history.full_expert_bytes IS 'bytes of all experts';
COMMENT ON COLUMN merge_history.error_bound IS 'the plan''s predicted bound';
COMMENT ON COLUMN merge_history.wall_seconds IS 'wall time in seconds';

COMMENT ON TABLE catalog_meta IS 'facts about the catalog itself, such as its schema version';
COMMENT ON COLUMN catalog_meta.key IS 'what: schema_version, or schema_sha256 (the digest of the schema statements a connection last ran)';
COMMENT ON COLUMN catalog_meta.value IS 'its value';

COMMENT ON TABLE index_claims IS 'experts being indexed now, one client each; the row goes when their statistics land';
COMMENT ON COLUMN index_claims.base_fp IS 'the base (models.model_fp)';
COMMENT ON COLUMN index_claims.expert_fp IS 'the expert being indexed (models.model_fp once indexed)';
COMMENT ON COLUMN index_claims.block_size IS 'block size in bytes';
COMMENT ON COLUMN index_claims.owner IS 'the claiming process: host, pid and a random part';
COMMENT ON COLUMN index_claims.claimed_at IS 'when it was claimed';
COMMENT ON COLUMN index_claims.heartbeat_at IS 'last sign of life; older than MERGEPIPE_CLAIM_STALE_SECONDS and another client takes it over';

COMMENT ON TABLE search_trials IS 'every trial of a merge search, and the final merges of its best trials';
COMMENT ON COLUMN search_trials.search IS 'the search: its Optuna study''s name (from the search config and --out)';
COMMENT ON COLUMN search_trials.trial IS 'the trial''s number in the study';
COMMENT ON COLUMN search_trials.final IS 'false: the budgeted trial; true: its merge again at the final budget';
COMMENT ON COLUMN search_trials.state IS 'complete, or failed (see error)';
COMMENT ON COLUMN search_trials.params_json IS 'the searched values, by dotted key';
COMMENT ON COLUMN search_trials.config_yaml IS 'the candidate merge config (without storage options)';
COMMENT ON COLUMN search_trials.plan_key IS 'the plan merged (saved_plans.plan_key)';
COMMENT ON COLUMN search_trials.budget IS 'the budget as given';
COMMENT ON COLUMN search_trials.budget_bytes IS 'the budget in expert bytes';
COMMENT ON COLUMN search_trials.expert_bytes_read IS 'expert bytes the merge read, from storage or from the block cache';
COMMENT ON COLUMN search_trials.input_bytes_read IS 'bytes the inputs'' storage (disk or network) sent: headers, base and experts, less what the block cache served';
COMMENT ON COLUMN search_trials.cache_bytes IS 'bytes of remote inputs the block cache served instead of the network';
COMMENT ON COLUMN search_trials.error_bound IS 'the plan''s predicted bound';
COMMENT ON COLUMN search_trials.score IS 'the evaluation''s score (the objective)';
COMMENT ON COLUMN search_trials.metrics_json IS 'the evaluation''s other numbers';
COMMENT ON COLUMN search_trials.error IS 'why the trial failed: the merge''s error, or the evaluation''s (with its stderr''s tail)';
COMMENT ON COLUMN search_trials.merge_seconds IS 'wall seconds of the merge';
COMMENT ON COLUMN search_trials.eval_seconds IS 'wall seconds of the evaluation';
COMMENT ON COLUMN search_trials.merge_digest IS 'the candidate''s digest';
COMMENT ON COLUMN search_trials.worker IS 'host:pid of the process that ran it';
COMMENT ON COLUMN search_trials.finished_at IS 'when it finished (UTC)';

COMMENT ON TABLE calibrations IS 'the base models run over calibration texts (mergepipe calibrate), for rank_by: activation';
COMMENT ON COLUMN calibrations.base_fp IS 'the base calibrated (models.model_fp)';
COMMENT ON COLUMN calibrations.data_digest IS 'SHA-256 of the texts used and max_length: the calibration''s key beside the base';
COMMENT ON COLUMN calibrations.data_uri IS 'where the texts were read from';
COMMENT ON COLUMN calibrations.texts IS 'texts run';
COMMENT ON COLUMN calibrations.tokens IS 'tokens run';
COMMENT ON COLUMN calibrations.max_length IS 'each text cut to this many tokens';
COMMENT ON COLUMN calibrations.device IS 'cuda or cpu';
COMMENT ON COLUMN calibrations.seconds IS 'wall seconds of loading and running the base';
COMMENT ON COLUMN calibrations.created_at IS 'when (UTC)';

COMMENT ON TABLE calibration_weights IS 'per base tensor a calibration reached: the weights of its delta''s energy';
COMMENT ON COLUMN calibration_weights.base_fp IS 'the base (calibrations.base_fp)';
COMMENT ON COLUMN calibration_weights.data_digest IS 'the calibration (calibrations.data_digest)';
COMMENT ON COLUMN calibration_weights.tensor IS 'the base''s tensor';
COMMENT ON COLUMN calibration_weights.kind IS 'input: E[x_j^2] of the input channels of the linear layer using it (its columns); token: each row''s token frequency (an embedding), times the relative gradient moment at its uses in a calibration with gradients; output: the relative E[g_r^2] of the linear layer''s output channels (its rows; calibrate --gradients)';
COMMENT ON COLUMN calibration_weights.n IS 'how many weights (columns, or rows)';
COMMENT ON COLUMN calibration_weights.weights IS 'n float64, little-endian';

COMMENT ON TABLE activation_stats IS 'per (expert, block) of a calibrated tensor: the predicted output energy of its delta';
COMMENT ON COLUMN activation_stats.base_fp IS 'the base the delta is taken against';
COMMENT ON COLUMN activation_stats.expert_fp IS 'the expert';
COMMENT ON COLUMN activation_stats.block_size IS 'the block size of the layout (blocks.block_size)';
COMMENT ON COLUMN activation_stats.data_digest IS 'the calibration (calibrations.data_digest)';
COMMENT ON COLUMN activation_stats.tensor IS 'the tensor';
COMMENT ON COLUMN activation_stats.block IS 'the block (blocks.block)';
COMMENT ON COLUMN activation_stats.act_sq IS 'sum over rows r and columns j of delta[r,j]^2 * (E[x_j^2] * output weight of row r + token weight of row r), in fp64';

COMMENT ON TABLE activation_sets IS 'experts whose activation_stats under a calibration are complete';
COMMENT ON COLUMN activation_sets.base_fp IS 'the base';
COMMENT ON COLUMN activation_sets.expert_fp IS 'the expert';
COMMENT ON COLUMN activation_sets.block_size IS 'the block size';
COMMENT ON COLUMN activation_sets.data_digest IS 'the calibration';
COMMENT ON COLUMN activation_sets.computed_at IS 'when (UTC)';
