//! The door to the node's BGP speaker, BIRD 2 (#48): the only module that
//! talks to it. lockstep decides what to announce (core `bgp`); BIRD
//! speaks BGP and BFD to the peers.
//!
//! BIRD runs as its own process (in Kubernetes, its own container of the
//! agent's pod, sharing a directory with the agent): the agent writes
//! BIRD's whole configuration there and applies it over BIRD's control
//! socket, and reads the sessions back the same way. An agent restart or
//! upgrade therefore leaves BIRD, its sessions and the routes it
//! announces untouched on the wire.
//!
//! Applying a configuration ([`Bird::apply`]) never loses the one that
//! runs: the new text is written beside it, BIRD is asked to read that
//! file, and only once BIRD took it does it replace the file BIRD reads
//! at its own start. A text BIRD refuses leaves both the running
//! configuration and the file as they were, and the error names BIRD's
//! reason (file, line, what).
//!
//! The control protocol: one command per line; every reply line starts
//! with a four-digit code, followed by `-` when more lines come and by a
//! space on the last; a line starting with a space continues the code
//! before it. Codes from 8000 are run-time errors, from 9000 parse errors.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// How long BIRD may take to answer one command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Why BIRD could not be driven.
#[derive(Debug, thiserror::Error)]
pub enum BirdError {
    /// The control socket could not be reached or broke.
    #[error("BIRD control socket {socket}: {source}")]
    Socket {
        /// The socket's path.
        socket: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// BIRD did not answer in time.
    #[error("BIRD control socket {socket}: no answer to {command:?} within {COMMAND_TIMEOUT:?}")]
    Timeout {
        /// The socket's path.
        socket: PathBuf,
        /// The command.
        command: String,
    },
    /// BIRD answered with an error code.
    #[error("BIRD refused {command:?}: {code} {text}")]
    Refused {
        /// The command.
        command: String,
        /// BIRD's reply code.
        code: u16,
        /// BIRD's words.
        text: String,
    },
    /// BIRD answered something this module cannot read.
    #[error("BIRD answered {command:?} with an unreadable line: {line:?}")]
    Garbled {
        /// The command.
        command: String,
        /// The line.
        line: String,
    },
    /// The configuration file could not be written or replaced.
    #[error("BIRD configuration {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// One line of a reply: its code and text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplyLine {
    /// The code (continuation lines carry the code before them).
    pub code: u16,
    /// The text after the code.
    pub text: String,
}

/// One protocol as BIRD reports it (`show protocols`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Protocol {
    /// Its name (`peer_<name>` for a peer: core `bgp::peer_protocol`).
    pub name: String,
    /// Its kind (`BGP`, `Static`, `BFD`, `Device`).
    pub kind: String,
    /// `up`, `start`, `down`...
    pub state: String,
    /// When it last changed state, as BIRD prints it (`Since`).
    pub since: String,
    /// The rest: for a BGP session its state (`Established`, `Active`,
    /// `Connect`...) and the last error, if any.
    pub info: String,
}

impl Protocol {
    /// Whether this is a BGP session that is established.
    pub fn established(&self) -> bool {
        self.kind == "BGP" && self.info.split_whitespace().next() == Some("Established")
    }

    /// What BIRD says went wrong with a BGP session that is not
    /// established (the info column past the session's state: a refused
    /// connection, a notification received or sent), if it says.
    pub fn problem(&self) -> Option<String> {
        if self.kind != "BGP" || self.established() {
            return None;
        }
        let rest = self
            .info
            .split_once(' ')
            .map(|(_, rest)| rest.trim())
            .unwrap_or_default();
        (!rest.is_empty()).then(|| rest.to_string())
    }
}

/// Where a reply stands after one more line.
enum Read {
    More,
    Done,
}

/// Reads one line of a reply into `lines`.
fn read_line(command: &str, line: &str, lines: &mut Vec<ReplyLine>) -> Result<Read, BirdError> {
    let garbled = || BirdError::Garbled {
        command: command.to_string(),
        line: line.to_string(),
    };
    if let Some(rest) = line.strip_prefix(' ') {
        let code = lines.last().map(|l| l.code).ok_or_else(garbled)?;
        lines.push(ReplyLine {
            code,
            text: rest.to_string(),
        });
        return Ok(Read::More);
    }
    let (head, text) = (
        line.get(..4).ok_or_else(garbled)?,
        line.get(5..).unwrap_or(""),
    );
    let code: u16 = head.parse().map_err(|_| garbled())?;
    let last = match line.as_bytes().get(4) {
        Some(b' ') | None => true,
        Some(b'-') => false,
        _ => return Err(garbled()),
    };
    lines.push(ReplyLine {
        code,
        text: text.to_string(),
    });
    Ok(if last { Read::Done } else { Read::More })
}

/// The first error line of a reply, as an error.
fn refused(command: &str, lines: &[ReplyLine]) -> Result<(), BirdError> {
    match lines.iter().find(|l| l.code >= 8000) {
        Some(l) => Err(BirdError::Refused {
            command: command.to_string(),
            code: l.code,
            text: l.text.trim().to_string(),
        }),
        None => Ok(()),
    }
}

/// Reads `show protocols`: one row per protocol after the header.
fn protocols(lines: &[ReplyLine]) -> Vec<Protocol> {
    lines
        .iter()
        .filter(|l| l.code == 1002)
        .filter_map(|l| {
            let mut cols = l.text.split_whitespace();
            let (name, kind, _table, state, since) = (
                cols.next()?,
                cols.next()?,
                cols.next()?,
                cols.next()?,
                cols.next()?,
            );
            Some(Protocol {
                name: name.to_string(),
                kind: kind.to_string(),
                state: state.to_string(),
                since: since.to_string(),
                info: cols.collect::<Vec<_>>().join(" "),
            })
        })
        .collect()
}

/// The node's BIRD: its control socket and the configuration file it
/// reads at start.
#[derive(Clone, Debug)]
pub struct Bird {
    socket: PathBuf,
    config: PathBuf,
}

impl Bird {
    /// BIRD reached at `socket`, started with `config` (`bird -c`).
    pub fn new(socket: impl Into<PathBuf>, config: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            config: config.into(),
        }
    }

    /// The configuration file BIRD reads at start.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Runs one command; its reply, or BIRD's error.
    ///
    /// # Errors
    /// The socket fails, BIRD is silent past its bound, or answers with an
    /// error code.
    pub async fn command(&self, command: &str) -> Result<Vec<ReplyLine>, BirdError> {
        let socket_error = |source| BirdError::Socket {
            socket: self.socket.clone(),
            source,
        };
        let run = async {
            let stream = UnixStream::connect(&self.socket)
                .await
                .map_err(socket_error)?;
            let (read, mut write) = stream.into_split();
            let mut read = BufReader::new(read).lines();
            // The greeting: "0001 BIRD 2.0.12 ready."
            let mut greeting = Vec::new();
            loop {
                let line = read.next_line().await.map_err(socket_error)?;
                let line =
                    line.ok_or_else(|| socket_error(std::io::ErrorKind::UnexpectedEof.into()))?;
                if let Read::Done = read_line("(greeting)", &line, &mut greeting)? {
                    break;
                }
            }
            write
                .write_all(format!("{command}\n").as_bytes())
                .await
                .map_err(socket_error)?;
            let mut lines = Vec::new();
            loop {
                let line = read.next_line().await.map_err(socket_error)?;
                let line =
                    line.ok_or_else(|| socket_error(std::io::ErrorKind::UnexpectedEof.into()))?;
                if let Read::Done = read_line(command, &line, &mut lines)? {
                    break;
                }
            }
            refused(command, &lines)?;
            Ok(lines)
        };
        tokio::time::timeout(COMMAND_TIMEOUT, run)
            .await
            .map_err(|_| BirdError::Timeout {
                socket: self.socket.clone(),
                command: command.to_string(),
            })?
    }

    /// Applies `text` as BIRD's whole configuration: written beside the
    /// running file, read by BIRD (`configure "<file>"`), and only then
    /// made the file BIRD reads at start. BIRD restarts only the
    /// protocols whose text changed. A text BIRD refuses changes nothing.
    ///
    /// # Errors
    /// The file cannot be written, the socket fails, or BIRD refuses the
    /// text (its reason named).
    pub async fn apply(&self, text: &str) -> Result<(), BirdError> {
        let next = self.config.with_extension("next");
        let file_error = |path: &Path| {
            let path = path.to_path_buf();
            move |source| BirdError::File { path, source }
        };
        tokio::fs::write(&next, text)
            .await
            .map_err(file_error(&next))?;
        let command = format!("configure \"{}\"", next.display());
        if let Err(e) = self.command(&command).await {
            let _ = tokio::fs::remove_file(&next).await;
            return Err(e);
        }
        tokio::fs::rename(&next, &self.config)
            .await
            .map_err(file_error(&self.config))
    }

    /// Writes `text` as the file BIRD starts from when there is none yet,
    /// so BIRD can be started after the agent (returns whether it wrote
    /// it). A file already there is left alone: it is what BIRD runs or
    /// will run, and [`Bird::apply`] replaces it only once BIRD took the
    /// new one.
    ///
    /// # Errors
    /// The file cannot be written.
    pub async fn seed(&self, text: &str) -> Result<bool, BirdError> {
        if tokio::fs::try_exists(&self.config).await.unwrap_or(false) {
            return Ok(false);
        }
        let file_error = |source| BirdError::File {
            path: self.config.clone(),
            source,
        };
        if let Some(dir) = self.config.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(file_error)?;
        }
        let next = self.config.with_extension("seed");
        tokio::fs::write(&next, text).await.map_err(file_error)?;
        tokio::fs::rename(&next, &self.config)
            .await
            .map_err(file_error)?;
        Ok(true)
    }

    /// Every protocol BIRD runs, with its state.
    ///
    /// # Errors
    /// As [`Bird::command`].
    pub async fn protocols(&self) -> Result<Vec<Protocol>, BirdError> {
        Ok(protocols(&self.command("show protocols").await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(command: &str, text: &str) -> Result<Vec<ReplyLine>, BirdError> {
        let mut lines = Vec::new();
        for line in text.lines() {
            if let Read::Done = read_line(command, line, &mut lines)? {
                return Ok(lines);
            }
        }
        panic!("no last line in {text:?}");
    }

    #[test]
    fn a_protocol_list_reads_with_its_sessions_state() {
        let lines = reply(
            "show protocols",
            "2002-Name       Proto      Table      State  Since         Info\n\
             1002-lockstep_device Device     ---        up     1796163902    \n\
             \x20peer_tor_a BGP        ---        up     1796163903    Established   \n\
             \x20peer_tor_b BGP        ---        start  1796163903    Active        Socket: Connection refused\n\
             0000 \n",
        )
        .unwrap();
        let p = protocols(&lines);
        assert_eq!(p.len(), 3);
        assert!(p[1].established() && !p[0].established() && !p[2].established());
        assert_eq!(p[2].state, "start");
        assert_eq!(p[1].since, "1796163903");
        assert_eq!(p[2].info, "Active Socket: Connection refused");
        assert_eq!(
            p[2].problem().as_deref(),
            Some("Socket: Connection refused")
        );
        assert_eq!((p[0].problem(), p[1].problem()), (None, None));
    }

    #[test]
    fn an_error_code_is_refused_with_birds_words() {
        let lines = reply(
            "configure \"/x\"",
            "0002-Reading configuration from /x\n8002 /x, line 3: syntax error\n",
        )
        .unwrap();
        let e = refused("configure \"/x\"", &lines).unwrap_err().to_string();
        assert_eq!(
            e,
            "BIRD refused \"configure \\\"/x\\\"\": 8002 /x, line 3: syntax error"
        );
    }

    #[test]
    fn a_line_without_a_code_is_garbled() {
        let mut lines = Vec::new();
        assert!(matches!(
            read_line("show protocols", "what", &mut lines),
            Err(BirdError::Garbled { .. })
        ));
        assert!(matches!(
            read_line("show protocols", " continued first", &mut lines),
            Err(BirdError::Garbled { .. })
        ));
    }
}
