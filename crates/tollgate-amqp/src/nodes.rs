//! The broker's nodes. `TOLLGATE_AMQP_URL` names one node, or the nodes of
//! one RabbitMQ cluster separated by commas. A connection goes to any live
//! node: each process starts at a node of its own (so a fleet spreads over
//! the cluster) and, when its node goes, tries the next one first.

use std::sync::atomic::{AtomicUsize, Ordering};

use lapin::uri::AMQPUri;
use tollgate_core::SecretUrl;

/// The nodes to connect to, and which to try first.
#[derive(Debug)]
pub struct Nodes {
    urls: Vec<SecretUrl>,
    /// The node tried first by the next connection.
    next: AtomicUsize,
}

impl Nodes {
    /// Parses one URL or several separated by commas (a comma inside a
    /// password must be percent-encoded, `%2C`). Every URL is checked, and
    /// an error shows the URL without its password.
    pub fn parse(list: &SecretUrl) -> Result<Self, String> {
        let urls: Vec<SecretUrl> = list
            .expose()
            .split(',')
            .map(|url| SecretUrl::new(url.trim()))
            .collect();
        for (i, url) in urls.iter().enumerate() {
            let which = if urls.len() == 1 {
                String::new()
            } else {
                format!(" (node {} of {})", i + 1, urls.len())
            };
            if url.expose().is_empty() {
                return Err(format!("an empty AMQP URL{which} in {list}"));
            }
            url.expose()
                .parse::<AMQPUri>()
                .map_err(|e| format!("{url}{which} is not an AMQP URL: {e}"))?;
        }
        Ok(Self {
            next: AtomicUsize::new(0),
            urls,
        })
    }

    /// Starts at node `first` (modulo the count): a process picks its own,
    /// so that a fleet does not connect to one node only.
    pub fn starting_at(self, first: usize) -> Self {
        self.next.store(first % self.urls.len(), Ordering::Relaxed);
        self
    }

    pub fn len(&self) -> usize {
        self.urls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// Every node with its index, from the one to try first, in turn.
    pub fn in_turn(&self) -> impl Iterator<Item = (usize, &SecretUrl)> {
        let first = self.next.load(Ordering::Relaxed);
        (0..self.urls.len()).map(move |k| {
            let i = (first + k) % self.urls.len();
            (i, &self.urls[i])
        })
    }

    /// A connection to node `i` was made: it is tried first next time.
    pub fn connected(&self, i: usize) {
        self.next.store(i, Ordering::Relaxed);
    }

    /// The connection to node `i` was lost: the next one tries the node
    /// after it first (the node may be down; if it is back, it is tried
    /// last).
    pub fn lost(&self, i: usize) {
        let _ = self.next.compare_exchange(
            i,
            (i + 1) % self.urls.len(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Every URL without its password, for logs and errors.
    pub fn redacted(&self) -> String {
        self.urls
            .iter()
            .map(SecretUrl::redacted)
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(list: &str) -> Result<Nodes, String> {
        Nodes::parse(&SecretUrl::new(list))
    }

    #[test]
    fn one_url_or_several_separated_by_commas() {
        let one = nodes("amqp://guest:guest@127.0.0.1:5672/%2f").unwrap();
        assert_eq!(one.len(), 1);
        let three =
            nodes("amqp://u:p@a:5672/%2f, amqp://u:p@b:5673/%2f,amqps://u:p@c/%2f").unwrap();
        assert_eq!(three.len(), 3);
        assert_eq!(
            three.redacted(),
            "amqp://u:REDACTED@a:5672/%2f,amqp://u:REDACTED@b:5673/%2f,amqps://u:REDACTED@c/%2f"
        );
    }

    #[test]
    fn a_bad_node_is_named_without_its_password() {
        let err = nodes("amqp://u:secret@a/%2f,http://u:secret@b/").unwrap_err();
        assert!(err.contains("(node 2 of 2)"), "{err}");
        assert!(err.contains("http://u:REDACTED@b/"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let err = nodes("amqp://u:secret@a/%2f,").unwrap_err();
        assert!(err.contains("an empty AMQP URL (node 2 of 2)"), "{err}");
        assert!(!err.contains("secret"), "{err}");
    }

    #[test]
    fn connections_go_round_the_nodes_from_the_one_after_a_lost_node() {
        let order = |n: &Nodes| n.in_turn().map(|(i, _)| i).collect::<Vec<_>>();
        let n = nodes("amqp://a,amqp://b,amqp://c").unwrap().starting_at(4);
        assert_eq!(order(&n), [1, 2, 0]);
        n.lost(1);
        assert_eq!(order(&n), [2, 0, 1]);
        // A loss reported late (another connection was made since) changes nothing.
        n.connected(0);
        n.lost(2);
        assert_eq!(order(&n), [0, 1, 2]);
        n.lost(0);
        assert_eq!(order(&n), [1, 2, 0]);
    }
}
