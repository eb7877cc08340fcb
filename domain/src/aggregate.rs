//! What every event-sourced resource shares: a typed event with its wire type and data, and an
//! aggregate folded from its stream (`<category>-<id>`) one event at a time. Commands decide on
//! the folded state; `vps_commands::pipeline` appends the events and folds the answer once.

use chrono::{DateTime, Utc};
use serde_json::Value;

/// A typed event of one stream category.
pub trait Event: Sized {
    /// The wire type (`pool.created`).
    fn event_type(&self) -> &'static str;
    /// The `data` as JSON (camelCase).
    fn data(&self) -> Value;
    /// Parses a stored event.
    fn from_parts(event_type: &str, data: Value) -> Result<Self, FoldError>;
}

/// A resource whose state is the fold of its stream. An aggregate says what its first event
/// makes ([`Aggregate::create`]) and what a later one changes ([`Aggregate::apply`]); the fold
/// ([`Aggregate::evolve`]) refuses a stream that is not created exactly once and counts the
/// version, so each aggregate's version is the number of events in its stream.
pub trait Aggregate: Sized + Clone + 'static {
    /// Its events.
    type Event: Event;
    /// The stream category: the stream of `id` is `<CATEGORY>-<id>`.
    const CATEGORY: &'static str;
    /// Whether a creating event may come again on a begun stream, its state replacing the old
    /// one (a put, as an image registration): otherwise it is [`FoldError::CreatedTwice`].
    const RECREATABLE: bool = false;
    /// The state `event`, recorded at `at`, makes as a stream's first event; `None` when it
    /// cannot start the stream. Its version is the fold's to set ([`Aggregate::evolve`]).
    fn create(event: &Self::Event, at: DateTime<Utc>) -> Option<Self>;
    /// What a later, non-creating event recorded at `at` changes (the version aside).
    fn apply(&mut self, event: &Self::Event, at: DateTime<Utc>);
    /// How many events made it: the stream version the next append expects.
    fn version(&self) -> u64;
    /// The version, for the fold to count.
    fn version_mut(&mut self) -> &mut u64;

    /// Applies one event recorded at `at` (`None`: the stream begins).
    fn evolve(
        state: Option<Self>,
        event: &Self::Event,
        at: DateTime<Utc>,
    ) -> Result<Self, FoldError> {
        let version = state.as_ref().map_or(0, Self::version) + 1;
        let mut next = match (state, Self::create(event, at)) {
            (None, Some(created)) => created,
            (Some(_), Some(created)) if Self::RECREATABLE => created,
            (Some(_), Some(_)) => {
                return Err(FoldError::CreatedTwice {
                    category: Self::CATEGORY,
                })
            }
            (None, None) => {
                return Err(FoldError::NotCreated {
                    category: Self::CATEGORY,
                    event_type: event.event_type().to_string(),
                })
            }
            (Some(mut existing), None) => {
                existing.apply(event, at);
                existing
            }
        };
        *next.version_mut() = version;
        Ok(next)
    }

    /// The stream of `id`.
    fn stream(id: &str) -> String {
        format!("{}-{id}", Self::CATEGORY)
    }

    /// The id whose stream `stream` is, when it is one of this category's.
    fn id_of_stream(stream: &str) -> Option<&str> {
        stream.strip_prefix(Self::CATEGORY)?.strip_prefix('-')
    }
}

/// A stream that cannot be folded: a bug or a damaged log, never a user error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FoldError {
    /// The stream's first event does not create the resource.
    #[error("{category} stream starts with {event_type}")]
    NotCreated {
        /// The category.
        category: &'static str,
        /// The event found.
        event_type: String,
    },
    /// A creating event after the stream began.
    #[error("{category} is created twice")]
    CreatedTwice {
        /// The category.
        category: &'static str,
    },
    /// An event type or data this category does not know.
    #[error("{event_type}: {message}")]
    Malformed {
        /// The type.
        event_type: String,
        /// What is wrong.
        message: String,
    },
}

/// Parses `{type, data}` into an adjacently tagged event enum.
pub fn parse_tagged<E: serde::de::DeserializeOwned>(
    event_type: &str,
    data: Value,
) -> Result<E, FoldError> {
    serde_json::from_value(serde_json::json!({ "type": event_type, "data": data })).map_err(|e| {
        FoldError::Malformed {
            event_type: event_type.to_string(),
            message: e.to_string(),
        }
    })
}

/// The `data` part of an adjacently tagged event enum.
pub fn tagged_data(event: &impl serde::Serialize) -> Value {
    match serde_json::to_value(event) {
        Ok(Value::Object(mut map)) => map.remove("data").unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

/// Folds events from nothing, each applied at its time.
pub fn fold<'a, A: Aggregate + 'a>(
    events: impl IntoIterator<Item = (&'a A::Event, DateTime<Utc>)>,
) -> Result<Option<A>, FoldError>
where
    A::Event: 'a,
{
    let mut state = None;
    for (event, at) in events {
        state = Some(A::evolve(state, event, at)?);
    }
    Ok(state)
}

/// Declares a stream's event enum: each variant wraps its payload and names its wire type.
/// The enum is adjacently tagged (`{ "type", "data" }`) and implements [`Event`].
#[macro_export]
macro_rules! event_enum {
    ($(#[$meta:meta])* pub enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident($payload:ty) = $wire:literal,)+
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(tag = "type", content = "data")]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $wire)] $variant($payload),)+
        }

        impl $name {
            /// Every wire type of the stream.
            pub const TYPES: &'static [&'static str] = &[$($wire),+];
        }

        impl $crate::aggregate::Event for $name {
            fn event_type(&self) -> &'static str {
                match self {
                    $(Self::$variant(_) => $wire,)+
                }
            }

            fn data(&self) -> serde_json::Value {
                $crate::aggregate::tagged_data(self)
            }

            fn from_parts(
                event_type: &str,
                data: serde_json::Value,
            ) -> Result<Self, $crate::aggregate::FoldError> {
                $crate::aggregate::parse_tagged(event_type, data)
            }
        }
    };
}
