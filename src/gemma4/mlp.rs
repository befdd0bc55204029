//! The dense gated MLP: `down(gelu_tanh(gate(x)) * up(x))`.

use candle_core::Tensor;

use super::Linear;
use crate::error::Result;
use crate::weights::WeightStore;

/// Dense GeGLU MLP of one layer (`layers.N.mlp.*`).
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj` for widths `hidden -> width -> hidden`.
    ///
    /// # Errors
    /// Missing or misshapen tensors.
    pub fn new(
        prefix: &str,
        layer: usize,
        hidden: usize,
        width: usize,
        vb: &WeightStore,
    ) -> Result<Self> {
        let lin = |name: &str, shape: [usize; 2]| -> Result<Linear> {
            Ok(Linear::from_loaded(vb.matrix(
                &format!("{prefix}.{name}"),
                Some(layer),
                &shape,
            )?))
        };
        Ok(Self {
            gate_proj: lin("gate_proj", [width, hidden])?,
            up_proj: lin("up_proj", [width, hidden])?,
            down_proj: lin("down_proj", [hidden, width])?,
        })
    }

    /// `[.., hidden] -> [.., hidden]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle's `gelu` is the tanh approximation (`gelu_pytorch_tanh`).
        let gate = self.gate_proj.forward(x)?.gelu()?;
        let up = self.up_proj.forward(x)?;
        self.down_proj.forward(&(gate * up)?)
    }
}

impl Mlp {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        self.gate_proj.resident_bytes()
            + self.up_proj.resident_bytes()
            + self.down_proj.resident_bytes()
    }
}
