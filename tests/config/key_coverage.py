"""Where each leaf key of :class:`megaflow.config.Config` is shown to do something, or refused.

``KEYS`` maps every dotted leaf key (``resources.pools.*.nodes`` for the fields of a named
pool) to one of:

* :class:`Consumed`: test node ids in which a non-default value of the key changes what the
  run does (a loss, a batch order, a layout, a refusal of an impossible layout the key
  causes), checked against an independently computed expectation. ``tests/config/
  test_every_key.py`` checks that each named test exists and that its source names the key
  (dotted or leaf name).
* :class:`Refused`: a value that ``load_run`` refuses with a ``ConfigError`` naming the
  key and saying what is supported (``supported`` is a fragment of that message; ``extra``
  are overrides needed to reach the check).

``GAPS`` lists keys that the code reads but that no fast or slow test yet shows changing the
outcome: each one needs such a test (the reason says what to measure). A key in neither
table fails ``test_every_key``, so a new key cannot be added without a row.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Consumed:
    """Tests (``tests/path.py::test_name``) in which changing the key changes behaviour."""

    tests: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """``load_run`` with ``<key>=<value>`` (after ``extra``) raises a ``ConfigError``
    keyed ``<key>`` whose message contains ``supported``."""

    value: str
    supported: str
    extra: tuple[str, ...] = ()


def consumed(*tests: str) -> Consumed:
    return Consumed(tuple(tests))


KE = "tests/config/test_key_effects.py::"
ON_POLICY = "tests/workers/test_on_policy_old_log_probs.py::"
HF = "tests/config/test_hf_architecture.py::"
KNOBS = "tests/config/test_config_knobs.py::"
TOPO = "tests/config/test_config_topology.py::"
PLAN = "tests/config/test_config_plan.py::"
GPU_PLAN = "tests/config/test_plan_gpu_runtime.py::"
LOSSES = "tests/algorithms/test_losses.py::"
ADV = "tests/algorithms/test_advantages.py::"
E2E_ALGO = "tests/trainer/test_e2e_algorithms.py::"
E2E_RC = "tests/trainer/test_e2e_rollout_correction.py::"
RC_STAGE = "tests/config/test_config_rollout_correction.py::"
E2E_TINY = "tests/trainer/test_e2e_tiny.py::"
WORKER_KNOBS = "tests/megatron/test_worker_knobs.py::"
SCALE = "tests/megatron/test_scale_knobs.py::"
MAIN_ERR = "tests/trainer/test_main_errors.py::"
SAFE = "tests/config/test_safe_rlhf_config.py::"
LORA = "tests/megatron/test_lora.py::"
LORA_CFG = "tests/config/test_lora_config.py::"
ARS = "tests/workers/test_actor_rollout_settings.py::test_the_engine_is_built_from_the_config_sections"
TRUNC = "tests/rollout/test_vllm_truncated_log_probs.py::"
AGENT_HOOK = "tests/agent/test_agent_hook.py::"


#: Overrides that enable a role on the tiny recipe (so that its layout is checked).
_TINY_HF = ("{model_type: llama, hidden_size: 128, intermediate_size: 384, num_hidden_layers: 2, "
            "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 16}")
_ENABLE = {"actor": (), "ref": ("ref.enabled=true", "algorithm.use_kl_loss=true"),
           "critic": ("critic.enabled=true", "algorithm.adv_estimator=gae"),
           "reward_model": ("reward_model.enabled=true", f"reward_model.hf_config={_TINY_HF}")}


def _parallel(role: str) -> dict:
    """tp/pp/cp/vpp/sequence_parallel of a role section."""
    tp_tests = {
        "actor": (TOPO + "test_tp_must_divide_the_attention_heads", TOPO + "test_world_size_must_be_tp_pp_cp_dp_exactly",
                  PLAN + "test_plan_uses_the_hybridflow_generation_layout"),
        "ref": (E2E_ALGO + "test_rloo_with_kl_loss",),
        "critic": (TOPO + "test_critic_tp_is_checked_against_the_same_model",),
        "reward_model": (TOPO + "test_reward_model_architecture_is_its_own",),
    }[role]
    pp_tests = {
        "actor": (TOPO + "test_pp_must_divide_the_layers", "tests/megatron/test_engine_parity.py::test_tp2_pp2_matches_single_process"),
        "ref": (PLAN + "test_impossible_memory_is_flagged_and_rejected",),
        "critic": (E2E_ALGO + "test_ppo_gae_critic_with_kl_in_reward",),
        "reward_model": (PLAN + "test_impossible_memory_is_flagged_and_rejected",),
    }[role]
    rows = {
        f"{role}.tp": consumed(*tp_tests),
        f"{role}.pp": consumed(*pp_tests),
        f"{role}.cp": Refused("2", "context parallelism is not supported yet: use cp=1"),
        # With a dense model ep > 1 is refused; with an MoE model ep is checked against the experts and
        # dp*cp (HF tests), and the actor's splits the experts (tests/megatron/test_moe_router_losses.py).
        f"{role}.ep": consumed("tests/megatron/test_moe_router_losses.py::"
                               "test_router_losses_and_grad_norm_are_independent_of_the_split",
                               HF + "test_expert_parallel_size_is_checked_against_experts_and_world")
        if role == "actor" else Refused("2", "expert parallelism needs a mixture-of-experts model",
                                        extra=_ENABLE[role]),
        f"{role}.vpp": Refused("2", "virtual pipeline stages are not supported yet: use vpp=null",
                               extra=(f"{role}.pp=2",)),
    }
    # On CPU the flag is refused at load (the local layer spec cannot run it); on GPUs it reaches
    # the TransformerConfig (the worker-config test) and the planner's activation account.
    rows[f"{role}.sequence_parallel"] = Refused("true", "not available on CPU", extra=_ENABLE[role])
    return rows


def _offload(role: str, parts: tuple[str, ...] = ("param", "grad", "optimizer")) -> dict:
    """The role's offload flags (forward-only roles have parameters only)."""
    test = WORKER_KNOBS + "test_each_offload_flag_offloads_exactly_its_part"
    return {f"{role}.{part}_offload": consumed(test) for part in parts}


def _optim(role: str) -> dict:
    schedule = (KNOBS + "test_decay_horizon_is_the_runs_optimizer_steps",
                KNOBS + "test_warmup_as_long_as_the_run_is_refused_for_a_decaying_schedule")
    return {
        f"{role}.optim.lr": consumed(SCALE + "test_lr_schedule_follows_closed_form_and_survives_resume"),
        f"{role}.optim.lr_warmup_steps": consumed(*schedule),
        f"{role}.optim.lr_decay_style": consumed(*schedule),
        f"{role}.optim.lr_decay_steps": consumed(SCALE + "test_lr_decay_steps_span_the_whole_run",
                                                 KNOBS + "test_decay_horizon_is_the_runs_optimizer_steps"),
        f"{role}.optim.min_lr": consumed(SCALE + "test_lr_schedule_follows_closed_form_and_survives_resume"),
    }


KEYS: dict[str, Consumed | Refused] = {
    # ------------------------------------------------------------------ model
    "model.path": consumed(HF + "test_a_checkpoint_config_json_is_refused_at_load_naming_file_and_field",
                           TOPO + "test_model_path_config_json_is_read_and_cross_checked"),
    "model.hf_config": consumed(HF + "test_planner_builder_and_mapping_agree_with_transformers",
                                TOPO + "test_tp_must_divide_the_attention_heads"),
    "model.tokenizer": consumed(MAIN_ERR + "test_dry_run_reports_every_problem_after_the_plan"),
    "model.dtype": consumed(KE + "test_model_dtype_sizes_the_planned_parameter_memory"),
    # ------------------------------------------------------------------ data
    "data.train_files": consumed(KE + "test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset"),
    "data.task": consumed(MAIN_ERR + "test_preflight_loads_the_data_without_creating_the_run_dir"),
    "data.task_args": consumed(MAIN_ERR + "test_dry_run_reports_every_problem_after_the_plan"),
    "data.prompt_key": consumed(KE + "test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset"),
    "data.max_prompt_length": consumed(KE + "test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset"),
    "data.filter_overlong_prompts": consumed(
        KE + "test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset"),
    "data.apply_chat_template": consumed(KE + "test_data_prompt_key_chat_template_and_length_filter_reach_the_dataset"),
    "data.train_batch_size": consumed(KE + "test_data_loader_keys_reach_the_prompt_loaders",
                                      TOPO + "test_num_training_steps"),
    "data.val_batch_size": consumed(KE + "test_data_loader_keys_reach_the_prompt_loaders"),
    "data.shuffle": consumed(KE + "test_data_loader_keys_reach_the_prompt_loaders"),
    "data.seed": consumed(KE + "test_data_loader_keys_reach_the_prompt_loaders"),
    # ------------------------------------------------------------------ algorithm
    "algorithm.adv_estimator": consumed(E2E_ALGO + "test_rloo_with_kl_loss", E2E_ALGO + "test_remax_with_fixed_kl_in_reward"),
    "algorithm.gamma": consumed(KE + "test_gamma_and_lam_shape_the_gae_advantages"),
    "algorithm.lam": consumed(KE + "test_gamma_and_lam_shape_the_gae_advantages"),
    "algorithm.norm_adv_by_std": consumed(KE + "test_norm_adv_by_std_divides_group_centred_scores_by_the_group_std"),
    "algorithm.use_kl_in_reward": consumed(E2E_ALGO + "test_remax_with_fixed_kl_in_reward"),
    "algorithm.kl_ctrl.type": consumed(E2E_ALGO + "test_remax_with_fixed_kl_in_reward"),
    "algorithm.kl_ctrl.kl_coef": consumed(E2E_ALGO + "test_remax_with_fixed_kl_in_reward"),
    "algorithm.kl_ctrl.target_kl": consumed(E2E_ALGO + "test_ppo_gae_critic_with_kl_in_reward"),
    "algorithm.kl_ctrl.horizon": consumed(E2E_ALGO + "test_ppo_gae_critic_with_kl_in_reward"),
    "algorithm.use_kl_loss": consumed(E2E_ALGO + "test_rloo_with_kl_loss"),
    "algorithm.kl_loss_coef": consumed(E2E_ALGO + "test_rloo_with_kl_loss", KE + "test_actor_loss_keys_change_the_worker_loss"),
    "algorithm.kl_loss_type": consumed(KE + "test_actor_loss_keys_change_the_worker_loss"),
    # Safe RLHF (tests/config/test_safe_rlhf_config.py; the run: tests/trainer/test_e2e_safe_rlhf.py)
    "algorithm.safe_rlhf.enable": consumed(SAFE + "test_enable_adds_the_cost_critic_on_the_critics_pool_with_its_settings"),
    "algorithm.safe_rlhf.cost_function": consumed(SAFE + "test_cost_function_and_cost_kwargs_choose_the_cost"),
    "algorithm.safe_rlhf.cost_kwargs": consumed(SAFE + "test_cost_function_and_cost_kwargs_choose_the_cost"),
    "algorithm.safe_rlhf.cost_limit": consumed(SAFE + "test_lambda_keys_drive_the_dual_ascent_by_hand"),
    "algorithm.safe_rlhf.lambda_init": consumed(SAFE + "test_lambda_keys_drive_the_dual_ascent_by_hand"),
    "algorithm.safe_rlhf.lambda_lr": consumed(SAFE + "test_lambda_keys_drive_the_dual_ascent_by_hand"),
    "algorithm.safe_rlhf.lambda_max": consumed(SAFE + "test_lambda_keys_drive_the_dual_ascent_by_hand"),
    "algorithm.filter_groups.enable": consumed(
        "tests/trainer/test_ppo_trainer_fake.py::test_filter_groups_trains_on_the_informative_groups_of_extra_rounds",
        "tests/trainer/test_dynamic_sampling.py::test_filter_groups_settings_that_cannot_work_are_refused_at_load"),
    "algorithm.filter_groups.metric": consumed(
        "tests/trainer/test_dynamic_sampling.py::test_split_groups_by_the_score_and_by_a_named_field",
        "tests/config/test_load_errors.py::test_a_metric_no_reward_of_the_run_gives_is_refused_at_load"),
    "algorithm.filter_groups.max_extra_rounds": consumed(
        "tests/trainer/test_dynamic_sampling.py::test_the_cap_completes_the_batch_with_flat_groups_and_says_so"),
    "algorithm.rollout_correction.is_level": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "algorithm.rollout_correction.rejection": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "algorithm.rollout_correction.rejection_lower": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "algorithm.rollout_correction.rejection_upper": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "algorithm.rollout_correction.bypass": consumed(E2E_RC + "test_bypass_skips_the_old_log_prob_pass_and_learns"),
    "algorithm.rollout_correction.bypass_loss_type": consumed(
        KE + "test_bypass_loss_recomputes_weights_and_rejection_in_the_worker_loss"),
    "algorithm.rollout_correction.reject_scope": consumed(
        "tests/trainer/test_ppo_trainer_fake.py::test_reject_scope_actor_or_whole_batch"),
    "algorithm.rollout_correction.preset": consumed(RC_STAGE + "test_verl_presets_set_verls_keys"),
    "algorithm.rollout_correction.rs": consumed(RC_STAGE + "test_stage_chained_verl_rejection_with_verls_metrics"),
    "algorithm.rollout_correction.rs_threshold": consumed(
        RC_STAGE + "test_stage_chained_verl_rejection_with_verls_metrics"),
    "algorithm.rollout_correction.is_batch_normalize": consumed(
        RC_STAGE + "test_icepop_weight_band_and_batch_normalisation"),
    "algorithm.rollout_correction.icepop_lower": consumed(RC_STAGE + "test_icepop_weight_band_and_batch_normalisation"),
    "algorithm.rollout_correction.icepop_upper": consumed(RC_STAGE + "test_icepop_weight_band_and_batch_normalisation"),
    "algorithm.rollout_correction.is_weight_tokens": consumed(
        RC_STAGE + "test_is_weight_tokens_chooses_kept_or_every_valid_token"),
    "algorithm.rollout_correction.max_mismatch": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    # ------------------------------------------------------------------ actor
    **_parallel("actor"),
    **_offload("actor"),
    "actor.moe_aux_loss_coeff": consumed("tests/megatron/test_moe_router_losses.py::"
                                         "test_router_losses_and_grad_norm_are_independent_of_the_split",
                                         HF + "test_router_loss_coefficients_are_refused_for_a_dense_model_and_with_full_recompute"),
    "actor.moe_z_loss_coeff": consumed("tests/megatron/test_moe_router_losses.py::"
                                       "test_router_losses_and_grad_norm_are_independent_of_the_split"),
    "actor.router_replay": consumed("tests/megatron/test_moe_routing_replay_engine.py::"
                                    "test_replaying_the_engine_routing_reproduces_transformers_and_splits_with_the_tokens",
                                    "tests/megatron/test_moe_r2_routing_replay.py::"
                                    "test_r2_records_the_routers_choice_and_the_update_replays_it",
                                    HF + "test_router_replay_is_refused_for_a_dense_model_and_with_full_recompute",
                                    HF + "test_router_replay_R2_needs_the_old_log_prob_forward_it_records_at"),
    "actor.recompute_granularity": consumed(WORKER_KNOBS + "test_recipe_knobs_reach_the_worker_config"),
    "actor.recompute_method": consumed(WORKER_KNOBS + "test_recipe_knobs_reach_the_worker_config"),
    "actor.recompute_num_layers": consumed(WORKER_KNOBS + "test_recipe_knobs_reach_the_worker_config"),
    **_optim("actor"),
    "actor.ppo_mini_batch_size": consumed(TOPO + "test_train_batch_sizes_by_hand",
                                          KNOBS + "test_decay_horizon_is_the_runs_optimizer_steps"),
    "actor.ppo_micro_batch_size_per_gpu": consumed(TOPO + "test_train_batch_sizes_by_hand"),
    "actor.use_dynamic_bsz": consumed(KNOBS + "test_token_budgets_reach_the_engines_and_small_budgets_are_refused"),
    "actor.ppo_max_token_len_per_gpu": consumed(
        KNOBS + "test_token_budgets_reach_the_engines_and_small_budgets_are_refused"),
    "actor.log_prob_max_token_len_per_gpu": consumed(
        KNOBS + "test_token_budgets_reach_the_engines_and_small_budgets_are_refused"),
    "actor.logits_chunk_tokens": consumed(KNOBS + "test_logits_chunk_tokens_reach_the_actor_and_ref_engines"),
    "actor.ppo_epochs": consumed(KE + "test_ppo_epochs_repeat_the_mini_batch_steps_of_an_update",
                                 KNOBS + "test_decay_horizon_is_the_runs_optimizer_steps"),
    "actor.on_policy_old_log_probs": consumed(
        ON_POLICY + "test_on_policy_ratio_is_one_and_gradient_matches_the_separate_forward",
        ON_POLICY + "test_on_policy_old_log_probs_refuses_what_needs_the_old_log_probs_first",
        "tests/trainer/test_on_policy_step.py::test_on_policy_step_skips_the_old_log_prob_call"),
    "actor.shuffle": consumed(WORKER_KNOBS + "test_shuffle_permutes_rows_reproducibly_per_step_epoch_and_rank",
                              WORKER_KNOBS + "test_order_is_kept_without_shuffle_or_with_one_mini_batch"),
    "actor.policy_loss": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "actor.clip_ratio_low": consumed(KE + "test_actor_loss_keys_change_the_worker_loss"),
    "actor.clip_ratio_high": consumed(KE + "test_actor_loss_keys_change_the_worker_loss"),
    "actor.loss_agg_mode": consumed(KE + "test_actor_loss_keys_change_the_worker_loss"),
    "actor.entropy_coeff": consumed(KE + "test_actor_loss_keys_change_the_worker_loss"),
    "actor.clip_ratio_c": consumed(E2E_RC + "test_cispo_with_tis_and_icepop_learns"),
    "actor.tau_pos": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.tau_neg": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.clip_cov_ratio": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.clip_cov_lb": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.clip_cov_ub": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.kl_cov_ratio": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.ppo_kl_coef": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    "actor.dro_beta": consumed(KE + "test_policy_loss_family_keys_change_the_worker_loss"),
    # ------------------------------------------------------------------ rollout
    "rollout.engine": Refused("hf", "expected one of 'vllm'"),
    "rollout.tp": consumed(PLAN + "test_plan_uses_the_hybridflow_generation_layout",
                           TOPO + "test_generation_sizes_hybridflow_example"),
    "rollout.pp": consumed(TOPO + "test_generation_sizes_hybridflow_example"),
    "rollout.n": consumed(E2E_ALGO + "test_ppo_gae_critic_with_kl_in_reward", TOPO + "test_train_batch_sizes_by_hand"),
    "rollout.response_length": consumed(PLAN + "test_kv_cache_too_small_for_one_sequence_on_cpu"),
    "rollout.cpu_kv_cache_gib": consumed(PLAN + "test_kv_cache_too_small_for_one_sequence_on_cpu",
                                         "tests/rollout/test_fixed_length_kv_auto.py::test_kv_auto_off_keeps_the_fixed_gib"),
    "rollout.cpu_kv_cache_auto": consumed("tests/rollout/test_fixed_length_kv_auto.py::test_kv_auto_matches_a_hand_computation"),
    "rollout.ignore_eos": consumed("tests/rollout/test_fixed_length_kv_auto.py::test_ignore_eos_drops_every_stop_id"),
    "rollout.val_do_sample": consumed(KE + "test_val_do_sample_makes_validation_sample_instead_of_decoding_greedily"),
    "rollout.verify_sync": consumed("tests/workers/test_actor_rollout_hybrid.py::test_verified_sync_reports_engine_equal_to_trainer"),
    "rollout.weight_sync_bucket_mb": consumed(
        "tests/workers/test_actor_rollout_hybrid.py::test_after_update_the_rollout_serves_the_new_weights",
        "tests/hybrid_engine/test_rollout_weights.py::test_a_bucket_size_below_one_mib_is_refused_at_load_naming_the_key"),
    "rollout.agent.enabled": consumed(
        AGENT_HOOK + "test_rollout_agent_enabled_sends_the_rows_messages_and_tools",
        "tests/agent/test_agent_preflight.py::test_a_template_without_a_tool_role_is_refused",
        "tests/agent/test_tiny_tool_learning.py::test_tiny_tool_grpo_learns_correct_calls"),
    "rollout.agent.max_turns": consumed(AGENT_HOOK + "test_rollout_agent_max_turns_ends_a_calling_trajectory"),
    "rollout.agent.tool_time_s": consumed(AGENT_HOOK + "test_rollout_agent_tool_time_s_ends_a_trajectory_after_its_tools"),
    # ------------------------------------------------------------------ ref
    **_parallel("ref"),
    "ref.enabled": consumed(E2E_ALGO + "test_rloo_with_kl_loss"),
    "ref.logits_chunk_tokens": consumed(KNOBS + "test_logits_chunk_tokens_reach_the_actor_and_ref_engines"),
    **_offload("ref", ("param",)),
    # ------------------------------------------------------------------ critic
    **_parallel("critic"),
    "critic.path": consumed("tests/trainer/test_e2e_smollm2.py::test_smollm2_gsm8k_grpo_runs_one_step"),
    "critic.ppo_mini_batch_size": consumed(E2E_ALGO + "test_ppo_gae_critic_with_kl_in_reward"),
    "critic.cliprange_value": consumed(KE + "test_critic_loss_keys_change_the_worker_value_loss"),
    "critic.loss_agg_mode": consumed(KE + "test_critic_loss_keys_change_the_worker_value_loss"),
    **_offload("critic"),
    **_optim("critic"),
    # ------------------------------------------------------------------ reward model
    **_parallel("reward_model"),
    "reward_model.hf_config": consumed(TOPO + "test_reward_model_architecture_is_its_own"),
    "reward_model.enabled": consumed(TOPO + "test_reward_model_architecture_is_its_own"),
    **_offload("reward_model", ("param",)),
    # ------------------------------------------------------------------ reward
    "reward.reward_kwargs": consumed("tests/rewards/test_reward_manager.py::test_verl_reward_model_field_and_mixed_sources"),
    "reward.functions": consumed(KE + "test_reward_keys_shape_the_runs_reward_table"),
    "reward.format_weight": consumed(KE + "test_reward_keys_shape_the_runs_reward_table"),
    "reward.format_pattern": consumed(KE + "test_reward_keys_shape_the_runs_reward_table"),
    # ------------------------------------------------------------------ trainer
    "trainer.total_steps": consumed(TOPO + "test_num_training_steps"),
    "trainer.total_epochs": consumed(TOPO + "test_num_training_steps"),
    "trainer.save_freq": consumed(E2E_TINY + "test_resume_continues_exactly",
                                  "tests/trainer/test_e2e_lora.py::test_lora_resume_continues_exactly"),
    "trainer.test_freq": consumed(KE + "test_validation_runs_only_with_val_files_and_a_cadence_or_a_pre_train_check"),
    "trainer.val_before_train": consumed(
        KE + "test_validation_runs_only_with_val_files_and_a_cadence_or_a_pre_train_check"),
    "trainer.val_max_samples": consumed(
        "tests/trainer/test_validation_bounds.py::test_val_max_samples_is_a_fixed_seeded_subset_reaching_the_val_loader"),
    "trainer.balance_batch": consumed(
        "tests/trainer/test_ppo_trainer_fake.py::test_balance_batch_gives_each_dp_rank_equal_rows_and_balanced_tokens"),
    "trainer.output_dir": consumed(KE + "test_run_directory_is_output_dir_project_experiment",
                                   MAIN_ERR + "test_bad_input_exits_2_with_the_key"),
    "trainer.resume": consumed(E2E_TINY + "test_resume_continues_exactly",
                               "tests/trainer/test_resume_checks.py::test_bad_resume_value_is_refused_at_load"),
    "trainer.resume_ignore_config_diff": consumed("tests/trainer/test_resume_checks.py::test_finished_run_says_so"),
    "trainer.max_ckpt_to_keep": consumed("tests/trainer/test_checkpoint.py::test_keep_last_prunes_old_complete_only"),
    "trainer.export_hf": consumed(E2E_TINY + "test_default_recipe_learns_on_policy",
                                  "tests/megatron/test_lora_export.py::test_exported_peft_adapter_matches_megaflow_log_probs"),
    "trainer.logger": consumed(KE + "test_trainer_logger_picks_the_runs_metric_sinks"),
    "trainer.generations_every": consumed(
        "tests/trainer/test_generations.py::test_training_logs_samples_every_n_steps_and_after_the_last"),
    "trainer.generations_count": consumed(
        "tests/trainer/test_generations.py::test_training_logs_samples_every_n_steps_and_after_the_last",
        "tests/trainer/test_generations.py::test_every_validation_logs_its_first_prompts"),
    "trainer.console_every": consumed("tests/tracking/test_tracking.py::test_console_line_every_n_steps_and_after_the_last"),
    "trainer.experiment_name": consumed(KE + "test_run_directory_is_output_dir_project_experiment",
                                        "tests/config/test_config_loader.py::test_recipe_path_and_invalid_yaml"),
    "trainer.project_name": consumed(KE + "test_run_directory_is_output_dir_project_experiment"),
    # ------------------------------------------------------------------ resources and ray
    "resources.nodes": consumed("tests/slurm/test_launch_resources.py::test_pools_sharing_a_node_add_up"),
    "resources.procs_per_node": consumed(MAIN_ERR + "test_local_resources_that_ray_would_wait_for_forever",
                                         TOPO + "test_world_size_must_be_tp_pp_cp_dp_exactly"),
    "resources.use_gpu": consumed("tests/config/test_config_schema.py::test_use_gpu_null_means_detect",
                                  MAIN_ERR + "test_local_resources_that_ray_would_wait_for_forever"),
    "resources.num_cpus_per_proc": consumed("tests/slurm/test_launch_resources.py::test_tiny_cpu_recipe_needs_one_node_of_two_cpus",
                                            MAIN_ERR + "test_local_resources_that_ray_would_wait_for_forever",
                                            "tests/single_controller/test_worker_group.py::"
                                            "test_each_rank_runs_one_thread_per_reserved_cpu"),
    "resources.gpu_memory_gib": consumed(PLAN + "test_impossible_memory_is_flagged_and_rejected"),
    "resources.cpu_memory_gib": consumed(PLAN + "test_host_memory_per_node_on_cpu",
                                         GPU_PLAN + "test_host_copies_per_node_on_gpu_by_hand"),
    "resources.gpu_runtime_headroom_gib": consumed(GPU_PLAN + "test_runtime_headroom_by_hand",
                                                   GPU_PLAN + "test_gpu_runtime_headroom_gib_decides_whether_a_layout_fits"),
    "resources.warn_pipeline_bubble": consumed(GPU_PLAN + "test_warning_thresholds_are_the_resources_keys"),
    "resources.warn_samples_per_replica": consumed(GPU_PLAN + "test_warning_thresholds_are_the_resources_keys"),
    "resources.pools.*.nodes": consumed(PLAN + "test_pools_first_fit_on_nodes", TOPO + "test_pools_and_placement"),
    "resources.pools.*.procs_per_node": consumed(PLAN + "test_pools_first_fit_on_nodes", TOPO + "test_pools_and_placement"),
    "resources.placement.actor": consumed(TOPO + "test_pools_and_placement"),
    "resources.placement.critic": consumed(TOPO + "test_pools_and_placement"),
    "ray.address": consumed(MAIN_ERR + "test_local_resources_that_fit_pass"),
    "ray.num_cpus": consumed(KE + "test_ray_keys_reach_ray_init"),
    "ray.namespace": consumed(KE + "test_ray_keys_reach_ray_init"),
    "ray.include_dashboard": consumed(KE + "test_ray_keys_reach_ray_init"),
    "ray.dashboard_host": consumed(KE + "test_ray_keys_reach_ray_init"),
    # ------------------------------------------------------------------ engines, placement, sampling
    "actor.log_prob_micro_batch_size_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "ref.log_prob_micro_batch_size_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "ref.use_dynamic_bsz": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "ref.log_prob_max_token_len_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.ppo_micro_batch_size_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.forward_micro_batch_size_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.use_dynamic_bsz": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.ppo_max_token_len_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.forward_max_token_len_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "reward_model.micro_batch_size_per_gpu": consumed(KE + "test_micro_batch_keys_and_token_budgets_reach_each_roles_engine"),
    "critic.recompute_granularity": consumed(KE + "test_critic_recompute_keys_reach_the_critic_model"),
    "critic.recompute_method": consumed(KE + "test_critic_recompute_keys_reach_the_critic_model"),
    "critic.recompute_num_layers": consumed(KE + "test_critic_recompute_keys_reach_the_critic_model"),
    "reward_model.path": consumed(KE + "test_the_reward_model_reads_its_own_checkpoint_and_a_critic_enables_its_group"),
    "critic.enabled": consumed(KE + "test_the_reward_model_reads_its_own_checkpoint_and_a_critic_enables_its_group"),
    "resources.placement.ref": consumed(KE + "test_ref_and_reward_model_placement_choose_their_pool"),
    "resources.placement.reward_model": consumed(KE + "test_ref_and_reward_model_placement_choose_their_pool"),
    "ray.resource_wait_timeout_s": consumed(KE + "test_the_cluster_wait_is_bounded_by_ray_resource_wait_timeout_s"),
    "rollout.temperature": consumed(ARS, "tests/rollout/test_vllm_rollout.py::test_sampled_log_probs_are_log_softmax_of_logits_over_temperature"),
    "rollout.top_p": consumed(ARS, TRUNC + "test_processed_log_probs_equal_the_truncated_recomputation"),
    "rollout.top_k": consumed(ARS, "tests/rollout/test_vllm_rollout.py::test_top_k_log_probs_are_of_the_truncated_distribution",
                              TRUNC + "test_processed_log_probs_equal_the_truncated_recomputation"),
    "rollout.logprobs_mode": consumed(
        "tests/workers/test_actor_rollout_settings.py::test_logprobs_mode_reaches_the_engine_and_the_trainers_log_probs",
        TRUNC + "test_raw_log_probs_are_over_the_whole_vocabulary",
        TRUNC + "test_processed_log_probs_equal_the_truncated_recomputation"),
    "rollout.gpu_memory_utilization": consumed(ARS),
    "rollout.sleep_level": consumed(
        "tests/workers/test_actor_rollout_settings.py::test_sleep_level_and_enforce_eager_reach_the_engine",
        "tests/rollout/test_vllm_engine_settings.py::test_sleep_level_reaches_vllm_and_level_2_invalidates_the_weights",
        "tests/workers/test_actor_rollout_settings.py::test_the_actor_re_syncs_an_engine_that_discarded_its_weights"),
    "rollout.enforce_eager": consumed(
        "tests/workers/test_actor_rollout_settings.py::test_sleep_level_and_enforce_eager_reach_the_engine",
        "tests/rollout/test_vllm_engine_settings.py::test_enforce_eager_by_device_unless_set"),
    "trainer.seed": consumed(ARS),
    "data.val_files": consumed(KE + "test_validation_files_become_the_validation_dataset"),
    "actor.optim.betas": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "actor.optim.eps": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "actor.optim.weight_decay": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "actor.optim.clip_grad": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "actor.use_distributed_optimizer": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.optim.betas": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.optim.eps": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.optim.weight_decay": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.optim.clip_grad": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.use_distributed_optimizer": consumed(KE + "test_optimizer_keys_reach_megatron_cores_optimizer"),
    "critic.ppo_epochs": consumed(KE + "test_ppo_epochs_repeat_the_mini_batch_steps_of_an_update"),
    "resources.placement.rollout": consumed(
        "tests/workers/test_split_placement.py::test_split_layout_equals_colocated_after_an_update",
        "tests/workers/test_split_placement.py::test_split_placement_is_refused_where_it_cannot_work"),
    "trainer.async_rollout": consumed(
        "tests/trainer/test_async_pipeline.py::test_async_run_learns_like_the_synchronous_one",
        "tests/trainer/test_async_pipeline.py::test_async_mode_turns_token_level_correction_on_unless_configured"),
    "trainer.max_staleness": consumed(
        "tests/trainer/test_async_pipeline.py::test_one_step_off_order_loader_state_and_staleness_bound"),
    "algorithm.kl_penalty": consumed(KE + "test_kl_penalty_picks_the_estimator_of_the_reward_stage"),
    "algorithm.rollout_correction.is_threshold": consumed(
        KE + "test_is_threshold_truncates_the_rollout_correction_weights"),
    "actor.lora.rank": consumed(LORA + "test_only_adapters_train_and_the_base_is_unchanged",
                                LORA_CFG + "test_kl_with_lora_needs_no_reference_group"),
    "actor.lora.alpha": consumed(LORA + "test_nonzero_b_forward_equals_merged_weights"),
    "actor.lora.dropout": consumed(LORA + "test_target_modules_and_dropout_knobs"),
    "actor.lora.target_modules": consumed(LORA + "test_target_modules_and_dropout_knobs"),
    "actor.lora.sync": consumed("tests/workers/test_lora_weight_sync.py::test_sync_serves_the_adapted_weights",
                                LORA_CFG + "test_adapter_sync_loads_colocated_and_sizes_the_engine"),
    **{f"critic.lora.{key}": consumed(LORA + "test_critic_lora_keeps_the_value_head_trainable")
       for key in ("rank", "alpha", "dropout", "target_modules")},
}

#: Keys the run reads but no test yet shows changing the outcome, with what a test should measure.
GAPS: dict[str, str] = {
}
