//! The dense gated MLP: `down(gelu_tanh(gate(x)) * up(x))`.

use candle_core::Tensor;

use super::Linear;
use crate::error::Result;
use crate::kernels::ops::geglu::geglu_matvec;
use crate::weights::WeightStore;

/// The gate and up projections: stacked into one `[gate; up]` product when both are dense (or
/// packed alike) and the model runs on CUDA.
#[derive(Debug, Clone)]
enum GateUp {
    /// `[2 * width, hidden]`: gate rows, then up rows.
    Stacked { weight: Linear, width: usize },
    /// One product each (off CUDA, or weights that cannot stack).
    Split { gate: Linear, up: Linear },
}

/// Dense GeGLU MLP of one layer (`layers.N.mlp.*`).
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_up: GateUp,
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
        // Stacked on CUDA only, as in attention.
        let stacked = if vb.device().is_cuda() {
            let parts = ["gate_proj", "up_proj"].map(|name| (format!("{prefix}.{name}"), width));
            vb.matrix_rows(&parts, Some(layer), hidden)?
        } else {
            None
        };
        let gate_up = match stacked {
            Some(weight) => GateUp::Stacked {
                weight: Linear::from_loaded(weight),
                width,
            },
            None => GateUp::Split {
                gate: lin("gate_proj", [width, hidden])?,
                up: lin("up_proj", [width, hidden])?,
            },
        };
        Ok(Self {
            gate_up,
            down_proj: lin("down_proj", [hidden, width])?,
        })
    }

    /// `[.., hidden] -> [.., hidden]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.down_input(x)? {
            (input, None) => self.down_proj.forward(&input),
            (gate, Some(up)) => self.down_proj.forward_gated(&gate, &up),
        }
    }

    /// The down projection's input: `(gelu_tanh(gate(x)) * up(x), None)` where one launch
    /// computes it (CUDA decode, one row, the stacked weight: the gate runs inside the
    /// product), else `(gate(x), Some(up(x)))`, the gate left to the down projection.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn down_input(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        if let GateUp::Stacked { weight, .. } = &self.gate_up {
            if let Some(h) = geglu_matvec(x, weight.weight())? {
                return Ok((h, None));
            }
        }
        let (gate, up) = self.gate_and_up(x)?;
        Ok((gate, Some(up)))
    }

    /// The gate and up projections of `x` (`[.., width]` each): the down projection's input is
    /// `gelu_tanh(gate) * up`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn gate_and_up(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match &self.gate_up {
            GateUp::Stacked { weight, width } => {
                let y = weight.forward(x)?;
                let last = y.rank() - 1;
                Ok((y.narrow(last, 0, *width)?, y.narrow(last, *width, *width)?))
            }
            GateUp::Split { gate, up } => Ok((gate.forward(x)?, up.forward(x)?)),
        }
    }

    /// The down projection.
    pub fn down_proj(&self) -> &Linear {
        &self.down_proj
    }
}

impl Mlp {
    /// Bytes of resident weights.
    pub fn resident_bytes(&self) -> usize {
        let gate_up = match &self.gate_up {
            GateUp::Stacked { weight, .. } => weight.resident_bytes(),
            GateUp::Split { gate, up } => gate.resident_bytes() + up.resident_bytes(),
        };
        gate_up + self.down_proj.resident_bytes()
    }
}
