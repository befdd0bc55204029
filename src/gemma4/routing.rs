//! Producer/consumer K/V routing within one forward: a KV-owning layer writes its own cache, and
//! a KV-shared layer reads the view its producer's cache returned earlier in the same step.
//! The eager forward and the decode-graph driver both route through [`KvRouting`].

use super::attention::KvInput;
use crate::config::KvSource;
use crate::error::{Error, Result};
use crate::kv::{KvView, ModelCache};

/// The views the producer layers of one forward returned, by layer.
#[derive(Debug)]
pub(crate) struct KvRouting<'p> {
    /// `producers[i]`: some later layer reads layer `i`'s K/V.
    producers: &'p [bool],
    views: Vec<Option<KvView>>,
}

impl<'p> KvRouting<'p> {
    /// Routing for a stack whose layer `i` is read by a later layer iff `producers[i]`.
    pub(crate) fn new(producers: &'p [bool]) -> Self {
        Self {
            producers,
            views: vec![None; producers.len()],
        }
    }

    /// Where layer `layer`'s K/V come from: its entry of `cache` when it owns K/V, its
    /// producer's view when it shares them.
    ///
    /// # Errors
    /// [`Error::Input`] when a KV-owning layer has no cache entry, or a shared layer's producer
    /// has not run yet in this forward.
    pub(crate) fn input<'a>(
        &'a self,
        layer: usize,
        source: KvSource,
        cache: &'a mut ModelCache,
    ) -> Result<KvInput<'a>> {
        match source {
            KvSource::Own => cache
                .layers
                .get_mut(layer)
                .and_then(Option::as_mut)
                .map(KvInput::Own)
                .ok_or_else(|| {
                    Error::Input(format!(
                        "layer {layer} owns K/V but the cache has no entry for it"
                    ))
                }),
            KvSource::Shared { producer } => self
                .views
                .get(producer)
                .and_then(Option::as_ref)
                .map(KvInput::Shared)
                .ok_or_else(|| {
                    Error::Input(format!(
                        "layer {layer} reads layer {producer}'s K/V, which was not produced"
                    ))
                }),
        }
    }

    /// Keeps the view layer `layer` returned when a later layer reads it.
    pub(crate) fn produced(&mut self, layer: usize, view: Option<KvView>) {
        if self.producers.get(layer).copied().unwrap_or(false) {
            self.views[layer] = view;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<KvInput<'_>>) -> String {
        match r {
            Ok(_) => "routed".to_string(),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn missing_cache_entry_and_unproduced_view_are_input_errors() {
        let producers = [true, false];
        let routing = KvRouting::new(&producers);
        let mut cache = ModelCache {
            layers: vec![None, None],
        };
        let own = message(routing.input(0, KvSource::Own, &mut cache));
        assert!(
            own.contains("layer 0 owns K/V but the cache has no entry for it"),
            "{own}"
        );
        let shared = message(routing.input(1, KvSource::Shared { producer: 0 }, &mut cache));
        assert!(
            shared.contains("layer 1 reads layer 0's K/V, which was not produced"),
            "{shared}"
        );
    }
}
