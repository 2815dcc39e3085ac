//! `config.json` of a Llama-family checkpoint (Llama, Mistral, Qwen2 — same block, small options).

use std::path::Path;

use crate::RuntimeError;

pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
pub struct ModelConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Q/K/V projections carry biases (Qwen2 always; Llama when `attention_bias`).
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> usize {
    4096
}

impl ModelConfig {
    pub fn load(dir: &Path) -> Result<ModelConfig, RuntimeError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| RuntimeError::io(&path, e))?;
        let cfg: ModelConfig = serde_json::from_str(&text)
            .map_err(|e| RuntimeError::Config(format!("{}: {e}", path.display())))?;
        cfg.validate()
            .map_err(|m| RuntimeError::Config(format!("{}: {m}", path.display())))?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        let arch = self.architectures.first().map(String::as_str).unwrap_or("");
        if !SUPPORTED_ARCHITECTURES.contains(&arch) {
            return Err(format!(
                "unsupported architecture '{arch}' (supported: {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            ));
        }
        if self.num_attention_heads == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return Err(
                "hidden_size, num_hidden_layers and num_attention_heads must be positive".into(),
            );
        }
        if !self.num_attention_heads.is_multiple_of(self.n_kv_heads()) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.n_kv_heads()
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if let Some(s) = &self.rope_scaling {
            if !s.is_null() {
                return Err(format!("rope_scaling {s} is not supported yet"));
            }
        }
        Ok(())
    }

    pub fn is_qwen2(&self) -> bool {
        self.architectures.first().map(String::as_str) == Some("Qwen2ForCausalLM")
    }
    pub fn has_qkv_bias(&self) -> bool {
        self.attention_bias || self.is_qwen2()
    }
    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads
            .unwrap_or(self.num_attention_heads)
            .max(1)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim()
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads() * self.head_dim()
    }
    /// All ids that end generation (config may give one id or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| vec![v as u32]).unwrap_or_default()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            _ => vec![],
        }
    }
}
