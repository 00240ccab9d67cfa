//! The login phase (RFC 7143 6.3 and 11.12/11.13) as a state machine over
//! login request PDUs: security negotiation, operational negotiation, then
//! the full feature phase. It does no I/O; the connection feeds it requests
//! and sends what it returns.

use super::chap;
use super::pdu::{op, Bhs};
use super::text::{self, Answer, Params, MAX_TEXT_BYTES, TARGET_MAX_RECV_DATA_SEGMENT};
use crate::volume::props::{IscsiAccess, IscsiAuthMode};

/// Login status classes and details (RFC 7143 11.13.5), as `class << 8 | detail`.
pub mod status {
    pub const SUCCESS: u16 = 0x0000;
    pub const INITIATOR_ERROR: u16 = 0x0200;
    pub const AUTHENTICATION_FAILED: u16 = 0x0201;
    pub const AUTHORIZATION_FAILED: u16 = 0x0202;
    pub const NOT_FOUND: u16 = 0x0203;
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    pub const MISSING_PARAMETER: u16 = 0x0207;
    pub const SESSION_TYPE_NOT_SUPPORTED: u16 = 0x0209;
    pub const SESSION_DOES_NOT_EXIST: u16 = 0x020a;
    pub const INVALID_DURING_LOGIN: u16 = 0x020b;
    pub const TARGET_ERROR: u16 = 0x0300;
    pub const OUT_OF_RESOURCES: u16 = 0x0302;
}

/// The answer to a login the target cannot take now (too many connections).
pub fn out_of_resources(request: &Bhs) -> Bhs {
    let mut login = Login::new(1);
    login.statsn = request.exp_statsn();
    login.fail(request, status::OUT_OF_RESOURCES).0
}

const SECURITY: u8 = 0;
const OPERATIONAL: u8 = 1;
const FULL_FEATURE: u8 = 3;
/// Longest iSCSI name (RFC 7143 4.2.7.1: 223 bytes).
const MAX_NAME_BYTES: usize = 223;

/// What the login machine asks of the target: which names exist and who may
/// log in to them, and how.
pub trait Directory {
    /// The access rules of `target_name`: `Ok(None)` when there is no such
    /// target, `Err` when they cannot be read (the login fails with a target
    /// error rather than letting anyone in).
    fn target(&self, target_name: &str) -> Result<Option<IscsiAccess>, String>;

    /// The rules for discovery sessions: `Ok(None)` when discovery is open
    /// (the default), `Err` when they cannot be read (refused).
    fn discovery(&self) -> Result<Option<IscsiAccess>, String> {
        Ok(None)
    }

    /// Fills `buf` with unpredictable bytes for CHAP challenges.
    fn random(&self, buf: &mut [u8]) -> std::io::Result<()> {
        chap::random_bytes(buf)
    }
}

/// Where the security negotiation (RFC 7143 6.3.1, 12.1.3) stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// No AuthMethod negotiated yet.
    Start,
    /// AuthMethod=None agreed.
    NoneAgreed,
    /// AuthMethod=CHAP agreed; waiting for CHAP_A.
    ChapAlgorithm,
    /// CHAP_A/CHAP_I/CHAP_C sent; waiting for CHAP_N and CHAP_R.
    ChapResponse {
        identifier: u8,
        challenge: [u8; chap::CHALLENGE_BYTES],
    },
    /// The initiator proved it knows the secret.
    ChapDone,
}

/// The CHAP keys of one login request.
#[derive(Default)]
struct ChapKeys<'a> {
    a: Option<&'a str>,
    i: Option<&'a str>,
    c: Option<&'a str>,
    n: Option<&'a str>,
    r: Option<&'a str>,
}

impl ChapKeys<'_> {
    fn any(&self) -> bool {
        self.a.is_some() || self.i.is_some() || self.c.is_some() || self.n.is_some() || self.r.is_some()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionType {
    Discovery,
    Normal,
}

/// The result of a successful login.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub initiator_name: String,
    pub target_name: Option<String>,
    pub session_type: SessionType,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub params: Params,
    /// The StatSN of the final login response; the full feature phase goes on from here.
    pub statsn: u32,
    /// The CmdSN the initiator will use next.
    pub exp_cmdsn: u32,
}

/// What to do after a login request.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Send the response and wait for the next login request.
    Continue,
    /// Send the response; the session enters the full feature phase.
    Complete(Box<Negotiated>),
    /// Send the response (a failure status) and close the connection.
    Fail,
}

/// The login state machine.
pub struct Login {
    stage: u8,
    started: bool,
    isid: [u8; 6],
    itt: u32,
    initiator_name: Option<String>,
    target_name: Option<String>,
    session_type: SessionType,
    params: Params,
    declared_tpgt: bool,
    declared_mrdsl: bool,
    /// Text of a request continued over several PDUs (C bit).
    continued: Vec<u8>,
    statsn: u32,
    window: u32,
    /// The target's access rules, read once when the target is named.
    access: Option<IscsiAccess>,
    auth: Auth,
    /// A complete request was processed: the names and the session type are fixed.
    identified: bool,
}

impl Login {
    /// `window` is the CmdSN window offered (MaxCmdSN - ExpCmdSN + 1).
    pub fn new(window: u32) -> Self {
        Login {
            stage: SECURITY,
            started: false,
            isid: [0; 6],
            itt: 0,
            initiator_name: None,
            target_name: None,
            session_type: SessionType::Normal,
            params: Params::default(),
            declared_tpgt: false,
            declared_mrdsl: false,
            continued: Vec::new(),
            statsn: 0,
            window,
            access: None,
            auth: Auth::Start,
            identified: false,
        }
    }

    /// Refuses the login and says why in the log (never with a secret).
    fn refuse(&self, request: &Bhs, status: u16, why: &str) -> (Bhs, Vec<u8>, Next) {
        tracing::info!(
            initiator = self.initiator_name.as_deref().unwrap_or("-"),
            target = self.target_name.as_deref().unwrap_or("-"),
            "iSCSI login refused (status 0x{status:04x}): {why}"
        );
        self.fail(request, status)
    }

    fn response(&self, request: &Bhs, flags: u8, status: u16) -> Bhs {
        let mut bhs = Bhs::new(op::LOGIN_RESPONSE);
        bhs.0[1] = flags;
        bhs.0[2] = 0; // version max
        bhs.0[3] = 0; // version active
        bhs.0[8..14].copy_from_slice(&request.0[8..14]);
        bhs.0[14..16].copy_from_slice(&request.0[14..16]);
        bhs.set_u32(16, request.itt());
        bhs.set_u32(24, self.statsn);
        let cmdsn = request.cmdsn();
        bhs.set_u32(28, cmdsn);
        bhs.set_u32(32, cmdsn.wrapping_add(self.window - 1));
        bhs.0[36] = (status >> 8) as u8;
        bhs.0[37] = status as u8;
        bhs
    }

    fn fail(&self, request: &Bhs, status: u16) -> (Bhs, Vec<u8>, Next) {
        let csg = (request.flags() >> 2) & 0x03;
        (self.response(request, csg << 2, status), Vec::new(), Next::Fail)
    }

    /// One CHAP exchange of the security stage: the algorithm offer, or the
    /// initiator's answer (and, for mutual CHAP, its challenge to us).
    fn chap_step(
        &mut self,
        keys: &ChapKeys,
        required: IscsiAuthMode,
        directory: &dyn Directory,
        reply: &mut Vec<(String, String)>,
    ) -> Result<(), (u16, &'static str)> {
        const MALFORMED: u16 = status::INITIATOR_ERROR;
        const DENIED: u16 = status::AUTHENTICATION_FAILED;
        match self.auth.clone() {
            Auth::ChapAlgorithm => {
                let Some(algorithms) = keys.a else {
                    return Err((status::MISSING_PARAMETER, "CHAP_A missing"));
                };
                if keys.i.is_some() || keys.c.is_some() || keys.n.is_some() || keys.r.is_some() {
                    return Err((MALFORMED, "CHAP keys out of order"));
                }
                if !chap::offers_md5(algorithms) {
                    return Err((DENIED, "the initiator does not offer CHAP with MD5 (CHAP_A=5)"));
                }
                let mut random = [0u8; 1 + chap::CHALLENGE_BYTES];
                if directory.random(&mut random).is_err() {
                    return Err((status::TARGET_ERROR, "no random bytes for a CHAP challenge"));
                }
                let identifier = random[0];
                let mut challenge = [0u8; chap::CHALLENGE_BYTES];
                challenge.copy_from_slice(&random[1..]);
                reply.push(("CHAP_A".into(), chap::ALGORITHM_MD5.into()));
                reply.push(("CHAP_I".into(), identifier.to_string()));
                reply.push(("CHAP_C".into(), chap::encode_hex(&challenge)));
                self.auth = Auth::ChapResponse { identifier, challenge };
                Ok(())
            }
            Auth::ChapResponse { identifier, challenge } => {
                if keys.a.is_some() {
                    return Err((MALFORMED, "CHAP_A sent twice"));
                }
                let (Some(name), Some(answer)) = (keys.n, keys.r) else {
                    return Err((status::MISSING_PARAMETER, "CHAP_N or CHAP_R missing"));
                };
                let answer = match chap::decode_binary(answer, chap::RESPONSE_BYTES) {
                    Ok(answer) if answer.len() == chap::RESPONSE_BYTES => answer,
                    _ => return Err((MALFORMED, "CHAP_R is not a 16-byte binary value")),
                };
                // The initiator's challenge to us, for mutual CHAP: both keys or neither.
                let mutual = match (keys.i, keys.c) {
                    (None, None) => None,
                    (Some(i), Some(c)) => {
                        let Some(i) = chap::parse_identifier(i) else {
                            return Err((MALFORMED, "CHAP_I is not a number from 0 to 255"));
                        };
                        let Ok(c) = chap::decode_binary(c, chap::MAX_CHALLENGE_BYTES) else {
                            return Err((MALFORMED, "CHAP_C is not a binary value of at most 1024 bytes"));
                        };
                        Some((i, c))
                    }
                    _ => return Err((MALFORMED, "CHAP_I without CHAP_C or the reverse")),
                };
                let access = self.access.as_ref().ok_or((DENIED, "no target"))?;
                if let Some((_, c)) = &mutual {
                    // A reflection attack hands our own challenge back to get
                    // it answered (RFC 7143 12.1.3).
                    if c.as_slice() == challenge.as_slice() {
                        return Err((DENIED, "the initiator reflected the target's CHAP challenge"));
                    }
                }
                let (Some(user), Some(secret)) = (&access.chap_user, &access.chap_secret) else {
                    return Err((DENIED, "iscsi.chap_user or iscsi.chap_secret is not set"));
                };
                let expected = chap::response(identifier, secret.as_bytes(), &challenge);
                // Both checks always run: the time taken does not tell which failed.
                let user_ok = chap::constant_time_eq(user.as_bytes(), name.as_bytes());
                let answer_ok = chap::constant_time_eq(&expected, &answer);
                if !(user_ok & answer_ok) {
                    return Err((DENIED, "wrong CHAP user or secret"));
                }
                match mutual {
                    Some((i, c)) => {
                        let (Some(user), Some(mutual_secret)) = (&access.mutual_user, &access.mutual_secret) else {
                            return Err((DENIED, "mutual CHAP asked, iscsi.mutual_user/mutual_secret not set"));
                        };
                        // RFC 7143 12.1.3: a secret used to authenticate
                        // initiators must not authenticate a target.
                        if mutual_secret == secret {
                            return Err((DENIED, "iscsi.mutual_secret equals iscsi.chap_secret"));
                        }
                        let ours = chap::response(i, mutual_secret.as_bytes(), &c);
                        reply.push(("CHAP_N".into(), user.clone()));
                        reply.push(("CHAP_R".into(), chap::encode_hex(&ours)));
                    }
                    None if required == IscsiAuthMode::Mutual => {
                        return Err((DENIED, "the target requires mutual CHAP; no CHAP_I/CHAP_C sent"));
                    }
                    None => {}
                }
                self.auth = Auth::ChapDone;
                Ok(())
            }
            _ => Err((MALFORMED, "CHAP keys without AuthMethod=CHAP in progress")),
        }
    }

    /// Processes one login request; returns the response header, its text
    /// and what to do next. `new_tsih` is called once, when login completes.
    pub fn step(
        &mut self,
        request: &Bhs,
        data: &[u8],
        directory: &dyn Directory,
        new_tsih: &mut dyn FnMut() -> u16,
    ) -> (Bhs, Vec<u8>, Next) {
        if request.opcode() != op::LOGIN {
            return self.fail(request, status::INVALID_DURING_LOGIN);
        }
        let flags = request.flags();
        let transit = flags & 0x80 != 0;
        let continues = flags & 0x40 != 0;
        let csg = (flags >> 2) & 0x03;
        let nsg = flags & 0x03;
        if !self.started {
            self.started = true;
            self.isid.copy_from_slice(&request.0[8..14]);
            self.itt = request.itt();
            self.statsn = request.exp_statsn();
            // Version-min above 0 asks for a protocol version we do not speak.
            if request.0[3] > 0 {
                return self.fail(request, status::UNSUPPORTED_VERSION);
            }
            // A non-zero TSIH adds a connection to, or reinstates, an existing
            // session; with MaxConnections=1 and ErrorRecoveryLevel=0 there is
            // no such session to join.
            if request.0[14..16] != [0, 0] {
                return self.fail(request, status::SESSION_DOES_NOT_EXIST);
            }
            if csg == OPERATIONAL {
                self.stage = OPERATIONAL;
            }
        } else if request.0[8..14] != self.isid {
            return self.fail(request, status::INITIATOR_ERROR);
        }
        if csg != self.stage || (transit && continues) {
            return self.fail(request, status::INITIATOR_ERROR);
        }
        if self.continued.len() + data.len() > MAX_TEXT_BYTES {
            return self.fail(request, status::INITIATOR_ERROR);
        }
        self.continued.extend_from_slice(data);
        if continues {
            // Acknowledge the partial text with an empty response.
            return (
                self.response(request, csg << 2, status::SUCCESS),
                Vec::new(),
                Next::Continue,
            );
        }
        let text = std::mem::take(&mut self.continued);
        let Ok(pairs) = text::parse(&text) else {
            return self.fail(request, status::INITIATOR_ERROR);
        };

        // Who is logging in to what. The names and the session type come
        // with the first request and may not change afterwards.
        for (key, value) in &pairs {
            match key.as_str() {
                "InitiatorName" => {
                    if value.is_empty() || value.len() > MAX_NAME_BYTES {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    if self.identified && self.initiator_name.as_deref() != Some(value.as_str()) {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    self.initiator_name = Some(value.clone());
                }
                "TargetName" => {
                    if value.len() > MAX_NAME_BYTES {
                        return self.fail(request, status::NOT_FOUND);
                    }
                    if self.identified && self.target_name.as_deref() != Some(value.as_str()) {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    self.target_name = Some(value.clone());
                }
                "SessionType" => {
                    let session_type = match value.as_str() {
                        "Discovery" => SessionType::Discovery,
                        "Normal" => SessionType::Normal,
                        _ => return self.fail(request, status::SESSION_TYPE_NOT_SUPPORTED),
                    };
                    if self.identified && session_type != self.session_type {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    self.session_type = session_type;
                }
                _ => {}
            }
        }
        self.identified = true;
        let Some(initiator_name) = self.initiator_name.clone() else {
            return self.fail(request, status::MISSING_PARAMETER);
        };
        // Discovery sessions only list targets: open unless the daemon's
        // `discovery_auth` asks for CHAP.
        let mut required = IscsiAuthMode::None;
        if self.session_type == SessionType::Discovery {
            if self.access.is_none() {
                match directory.discovery() {
                    Ok(access) => self.access = access,
                    Err(e) => return self.refuse(request, status::TARGET_ERROR, &e),
                }
            }
            if let Some(access) = &self.access {
                required = access.auth;
            }
        }
        if self.session_type == SessionType::Normal {
            let Some(target) = self.target_name.clone() else {
                return self.fail(request, status::MISSING_PARAMETER);
            };
            if self.access.is_none() {
                match directory.target(&target) {
                    Ok(Some(access)) => self.access = Some(access),
                    Ok(None) => return self.fail(request, status::NOT_FOUND),
                    Err(e) => return self.refuse(request, status::TARGET_ERROR, &e),
                }
            }
            let access = self.access.as_ref().expect("looked up above");
            if !access.initiator_allowed(&initiator_name) {
                return self.refuse(
                    request,
                    status::AUTHORIZATION_FAILED,
                    "initiator not in iscsi.initiators",
                );
            }
            required = access.auth;
        }
        if required != IscsiAuthMode::None && self.stage != SECURITY && self.auth != Auth::ChapDone {
            return self.refuse(
                request,
                status::AUTHENTICATION_FAILED,
                "the target requires CHAP; the initiator skipped security negotiation",
            );
        }

        let mut reply: Vec<(String, String)> = Vec::new();
        let mut chap_keys = ChapKeys::default();
        for (key, value) in &pairs {
            match key.as_str() {
                "InitiatorName" | "TargetName" | "SessionType" => {}
                "AuthMethod" => {
                    if self.stage != SECURITY {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    let offered = |method: &str| value.split(',').any(|m| m == method);
                    match (&self.auth, required) {
                        (Auth::Start | Auth::NoneAgreed, IscsiAuthMode::None) if offered("None") => {
                            self.auth = Auth::NoneAgreed;
                            reply.push((key.clone(), "None".into()));
                        }
                        (Auth::Start, IscsiAuthMode::Chap | IscsiAuthMode::Mutual) if offered("CHAP") => {
                            self.auth = Auth::ChapAlgorithm;
                            reply.push((key.clone(), "CHAP".into()));
                        }
                        (Auth::Start, _) => {
                            return self.refuse(
                                request,
                                status::AUTHENTICATION_FAILED,
                                "no acceptable AuthMethod offered",
                            );
                        }
                        _ => return self.fail(request, status::INITIATOR_ERROR),
                    }
                }
                "CHAP_A" | "CHAP_I" | "CHAP_C" | "CHAP_N" | "CHAP_R" => {
                    if self.stage != SECURITY {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    let slot = match key.as_str() {
                        "CHAP_A" => &mut chap_keys.a,
                        "CHAP_I" => &mut chap_keys.i,
                        "CHAP_C" => &mut chap_keys.c,
                        "CHAP_N" => &mut chap_keys.n,
                        _ => &mut chap_keys.r,
                    };
                    *slot = Some(value.as_str());
                }
                _ => {
                    let discovery = self.session_type == SessionType::Discovery;
                    match text::negotiate(key, value, &mut self.params, discovery) {
                        Answer::Reply(answer) => reply.push((key.clone(), answer)),
                        Answer::Silent => {}
                        Answer::NotUnderstood => reply.push((key.clone(), "NotUnderstood".into())),
                        Answer::Reject => reply.push((key.clone(), "Reject".into())),
                    }
                }
            }
        }
        if chap_keys.any() {
            if let Err((status, why)) = self.chap_step(&chap_keys, required, directory, &mut reply) {
                return self.refuse(request, status, why);
            }
        }
        if self.session_type == SessionType::Normal && !self.declared_tpgt {
            self.declared_tpgt = true;
            reply.push(("TargetPortalGroupTag".into(), "1".into()));
        }
        // Leaving the security stage needs a finished authentication. While
        // CHAP is under way the answer simply does not transit (T=0).
        let mut transit = transit;
        if transit && self.stage == SECURITY && required != IscsiAuthMode::None && self.auth != Auth::ChapDone {
            if self.auth == Auth::Start {
                return self.refuse(
                    request,
                    status::AUTHENTICATION_FAILED,
                    "the target requires CHAP; the initiator offered no AuthMethod",
                );
            }
            transit = false;
        }
        let mut response_flags = csg << 2;
        if transit {
            let valid = matches!(
                (csg, nsg),
                (SECURITY, OPERATIONAL) | (SECURITY, FULL_FEATURE) | (OPERATIONAL, FULL_FEATURE)
            );
            if !valid {
                return self.fail(request, status::INITIATOR_ERROR);
            }
            response_flags |= 0x80 | nsg;
        }
        let entering_operational = csg == OPERATIONAL || (transit && nsg == OPERATIONAL);
        if entering_operational && csg == OPERATIONAL && !self.declared_mrdsl {
            self.declared_mrdsl = true;
            reply.push((
                "MaxRecvDataSegmentLength".into(),
                TARGET_MAX_RECV_DATA_SEGMENT.to_string(),
            ));
        }
        let text = text::encode(&reply);
        if transit {
            self.stage = nsg;
        }
        if transit && nsg == FULL_FEATURE {
            let tsih = new_tsih();
            let mut bhs = self.response(request, response_flags, status::SUCCESS);
            bhs.0[14..16].copy_from_slice(&tsih.to_be_bytes());
            let negotiated = Negotiated {
                initiator_name,
                target_name: self.target_name.clone(),
                session_type: self.session_type,
                isid: self.isid,
                tsih,
                params: self.params,
                statsn: self.statsn,
                exp_cmdsn: request.cmdsn(),
            };
            return (bhs, text, Next::Complete(Box::new(negotiated)));
        }
        (
            self.response(request, response_flags, status::SUCCESS),
            text,
            Next::Continue,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `iqn.t:a` (no authentication, `iqn.denied` not allowed), `iqn.t:chap`
    /// (CHAP as alice), `iqn.t:mutual` (mutual CHAP), `iqn.t:same` (mutual
    /// with the same secret both ways, which the RFC forbids).
    struct OneTarget;

    const ALICE_SECRET: &str = "alice-secret-1";
    const TARGET_SECRET: &str = "target-secret-2";

    fn access(auth: IscsiAuthMode, mutual_secret: &str) -> IscsiAccess {
        IscsiAccess {
            auth,
            chap_user: Some("alice".into()),
            chap_secret: Some(ALICE_SECRET.into()),
            mutual_user: Some("target".into()),
            mutual_secret: Some(mutual_secret.into()),
            initiators: None,
        }
    }

    impl Directory for OneTarget {
        fn target(&self, name: &str) -> Result<Option<IscsiAccess>, String> {
            Ok(match name {
                "iqn.t:a" => Some(IscsiAccess {
                    initiators: Some(vec!["iqn.i".into(), "iqn.other".into()]),
                    ..access(IscsiAuthMode::None, TARGET_SECRET)
                }),
                "iqn.t:chap" => Some(access(IscsiAuthMode::Chap, TARGET_SECRET)),
                "iqn.t:mutual" => Some(access(IscsiAuthMode::Mutual, TARGET_SECRET)),
                "iqn.t:same" => Some(access(IscsiAuthMode::Mutual, ALICE_SECRET)),
                "iqn.t:broken" => return Err("catalog unreadable".into()),
                _ => None,
            })
        }
    }

    fn request(flags: u8, cmdsn: u32) -> Bhs {
        let mut bhs = Bhs::new(op::LOGIN | 0x40);
        bhs.0[1] = flags;
        bhs.0[8..14].copy_from_slice(&[0x80, 0, 0, 1, 0, 0]);
        bhs.set_u32(16, 7);
        bhs.set_u32(24, cmdsn);
        bhs
    }

    fn status_of(bhs: &Bhs) -> u16 {
        u16::from_be_bytes([bhs.0[36], bhs.0[37]])
    }

    #[test]
    fn login_straight_to_full_feature() {
        let mut login = Login::new(128);
        let text = b"InitiatorName=iqn.i\0TargetName=iqn.t:a\0AuthMethod=None\0";
        let (bhs, _, next) = login.step(&request(0x81, 1), text, &OneTarget, &mut || 5);
        assert_eq!(status_of(&bhs), 0);
        assert_eq!(next, Next::Continue);
        let text = b"HeaderDigest=CRC32C,None\0MaxRecvDataSegmentLength=65536\0X-Foo=1\0";
        let (bhs, reply, next) = login.step(&request(0x87, 1), text, &OneTarget, &mut || 5);
        assert_eq!(status_of(&bhs), 0);
        let reply = String::from_utf8(reply).unwrap();
        assert!(reply.contains("HeaderDigest=CRC32C"));
        assert!(reply.contains("X-Foo=NotUnderstood"));
        let Next::Complete(negotiated) = next else {
            panic!("login did not complete")
        };
        assert_eq!(negotiated.tsih, 5);
        assert_eq!(negotiated.params.initiator_max_recv_data_segment, 65536);
        assert_eq!(&bhs.0[14..16], &[0, 5]);
    }

    #[test]
    fn unknown_target_and_denied_initiator_fail() {
        let mut login = Login::new(128);
        let (bhs, _, next) = login.step(
            &request(0x81, 1),
            b"InitiatorName=iqn.i\0TargetName=iqn.t:zz\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!((status_of(&bhs), next), (status::NOT_FOUND, Next::Fail));
        let mut login = Login::new(128);
        let (bhs, _, _) = login.step(
            &request(0x81, 1),
            b"InitiatorName=IQN.DENIED\0TargetName=iqn.t:a\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!(status_of(&bhs), status::AUTHORIZATION_FAILED);
        // Names compare case-insensitively.
        let mut login = Login::new(128);
        let (bhs, _, _) = login.step(
            &request(0x81, 1),
            b"InitiatorName=IQN.Other\0TargetName=iqn.t:a\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!(status_of(&bhs), status::SUCCESS);
        let mut login = Login::new(128);
        let (bhs, _, _) = login.step(
            &request(0x81, 1),
            b"InitiatorName=iqn.i\0TargetName=iqn.t:broken\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!(status_of(&bhs), status::TARGET_ERROR);
    }

    #[test]
    fn missing_initiator_name_and_long_keys_fail() {
        let mut login = Login::new(128);
        let (bhs, _, _) = login.step(&request(0x81, 1), b"TargetName=iqn.t:a\0", &OneTarget, &mut || 1);
        assert_eq!(status_of(&bhs), status::MISSING_PARAMETER);
        let mut long = vec![b'A'; 1000];
        long.extend_from_slice(b"=x\0");
        let mut login = Login::new(128);
        let (bhs, reply, next) = login.step(&request(0x81, 1), &long, &OneTarget, &mut || 1);
        assert_eq!((status_of(&bhs), next), (status::INITIATOR_ERROR, Next::Fail));
        assert!(reply.is_empty(), "a long key is never echoed back");
    }

    #[test]
    fn non_login_pdu_during_login_fails() {
        let mut login = Login::new(128);
        let (_, _, next) = login.step(&Bhs::new(op::SCSI_COMMAND), &[], &OneTarget, &mut || 1);
        assert_eq!(next, Next::Fail);
    }

    #[test]
    fn chap_only_is_refused_without_secrets() {
        let mut login = Login::new(128);
        let (bhs, _, next) = login.step(
            &request(0x81, 1),
            b"InitiatorName=iqn.i\0TargetName=iqn.t:a\0AuthMethod=CHAP\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!((status_of(&bhs), next), (status::AUTHENTICATION_FAILED, Next::Fail));
    }

    fn keys(reply: &[u8]) -> std::collections::HashMap<String, String> {
        text::parse(reply).unwrap().into_iter().collect()
    }

    /// Runs AuthMethod and CHAP_A on `target`; returns the login and the
    /// target's identifier and challenge.
    fn chap_until_challenge(target: &str) -> (Login, u8, Vec<u8>) {
        let mut login = Login::new(128);
        let first = format!("InitiatorName=iqn.i\0TargetName={target}\0AuthMethod=CHAP,None\0");
        let (bhs, reply, next) = login.step(&request(0x81, 1), first.as_bytes(), &OneTarget, &mut || 1);
        assert_eq!((status_of(&bhs), next), (status::SUCCESS, Next::Continue));
        assert_eq!(bhs.0[1] & 0x80, 0, "no transit before CHAP is done");
        assert_eq!(keys(&reply)["AuthMethod"], "CHAP");
        let (bhs, reply, next) = login.step(&request(0x01, 1), b"CHAP_A=7,5\0", &OneTarget, &mut || 1);
        assert_eq!((status_of(&bhs), next), (status::SUCCESS, Next::Continue));
        let reply = keys(&reply);
        assert_eq!(reply["CHAP_A"], "5");
        let identifier: u8 = reply["CHAP_I"].parse().unwrap();
        let challenge = chap::decode_binary(&reply["CHAP_C"], 1024).unwrap();
        assert!(challenge.len() >= 16);
        (login, identifier, challenge)
    }

    fn answer(identifier: u8, secret: &str, challenge: &[u8]) -> String {
        chap::encode_hex(&chap::response(identifier, secret.as_bytes(), challenge))
    }

    /// Sends the CHAP answer with T=1 towards operational; returns status and reply.
    fn send(login: &mut Login, text: &str) -> (u16, Bhs, Vec<u8>, Next) {
        let (bhs, reply, next) = login.step(&request(0x81, 1), text.as_bytes(), &OneTarget, &mut || 1);
        (status_of(&bhs), bhs, reply, next)
    }

    #[test]
    fn chap_success_then_operational_and_full_feature() {
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:chap");
        let text = format!("CHAP_N=alice\0CHAP_R={}\0", answer(id, ALICE_SECRET, &challenge));
        let (status, bhs, reply, next) = send(&mut login, &text);
        assert_eq!((status, next), (status::SUCCESS, Next::Continue));
        assert_eq!(bhs.0[1] & 0x83, 0x81, "transit to operational");
        assert!(!keys(&reply).contains_key("CHAP_R"), "no mutual answer unasked");
        let (bhs, _, next) = login.step(&request(0x87, 1), b"", &OneTarget, &mut || 9);
        assert_eq!(status_of(&bhs), status::SUCCESS);
        assert!(matches!(next, Next::Complete(_)));
    }

    #[test]
    fn chap_accepts_base64_answers() {
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:chap");
        let hex = answer(id, ALICE_SECRET, &challenge);
        let bytes = chap::decode_binary(&hex, 16).unwrap();
        // Base64 by hand: 16 bytes are 5 groups of 3 plus one byte.
        const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut b64 = String::from("0b");
        for group in bytes.chunks(3) {
            let mut bits = 0u32;
            for (k, &b) in group.iter().enumerate() {
                bits |= u32::from(b) << (16 - 8 * k);
            }
            for k in 0..=group.len() {
                b64.push(ALPHABET[(bits >> (18 - 6 * k) & 63) as usize] as char);
            }
            b64.push_str(&"=".repeat(3 - group.len()));
        }
        let (status, _, _, _) = send(&mut login, &format!("CHAP_N=alice\0CHAP_R={b64}\0"));
        assert_eq!(status, status::SUCCESS);
    }

    #[test]
    fn chap_wrong_secret_or_unknown_user_fails_authentication() {
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:chap");
        let text = format!("CHAP_N=alice\0CHAP_R={}\0", answer(id, "not-the-secret", &challenge));
        let (status, _, reply, next) = send(&mut login, &text);
        assert_eq!((status, next), (status::AUTHENTICATION_FAILED, Next::Fail));
        assert!(reply.is_empty());
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:chap");
        let text = format!("CHAP_N=mallory\0CHAP_R={}\0", answer(id, ALICE_SECRET, &challenge));
        assert_eq!(send(&mut login, &text).0, status::AUTHENTICATION_FAILED);
    }

    #[test]
    fn chap_malformed_oversized_and_missing_keys_fail() {
        // Oversized CHAP_R (within the text limits, far beyond 16 bytes).
        let (mut login, _, _) = chap_until_challenge("iqn.t:chap");
        let text = format!("CHAP_N=alice\0CHAP_R=0x{}\0", "ab".repeat(1000));
        assert_eq!(send(&mut login, &text).0, status::INITIATOR_ERROR);
        // Short, non-hex and unprefixed responses.
        for bad in ["0x00", "0xzz", "abcdef", "0b"] {
            let (mut login, _, _) = chap_until_challenge("iqn.t:chap");
            let text = format!("CHAP_N=alice\0CHAP_R={bad}\0");
            assert_eq!(send(&mut login, &text).0, status::INITIATOR_ERROR, "{bad}");
        }
        // Missing CHAP_R.
        let (mut login, _, _) = chap_until_challenge("iqn.t:chap");
        assert_eq!(send(&mut login, "CHAP_N=alice\0").0, status::MISSING_PARAMETER);
        // Oversized CHAP_C for mutual CHAP.
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:mutual");
        let text = format!(
            "CHAP_N=alice\0CHAP_R={}\0CHAP_I=1\0CHAP_C=0x{}\0",
            answer(id, ALICE_SECRET, &challenge),
            "cd".repeat(1025)
        );
        assert_eq!(send(&mut login, &text).0, status::INITIATOR_ERROR);
        // CHAP_I out of range, CHAP_C without CHAP_I.
        for extra in ["CHAP_I=256\0CHAP_C=0x0102", "CHAP_C=0x0102"] {
            let (mut login, id, challenge) = chap_until_challenge("iqn.t:mutual");
            let text = format!(
                "CHAP_N=alice\0CHAP_R={}\0{extra}\0",
                answer(id, ALICE_SECRET, &challenge)
            );
            assert_eq!(send(&mut login, &text).0, status::INITIATOR_ERROR, "{extra}");
        }
        // No MD5 among the algorithms.
        let mut login = Login::new(128);
        send(
            &mut login,
            "InitiatorName=iqn.i\0TargetName=iqn.t:chap\0AuthMethod=CHAP\0",
        );
        assert_eq!(send(&mut login, "CHAP_A=6,7\0").0, status::AUTHENTICATION_FAILED);
        // CHAP keys out of order: a response before any challenge.
        let mut login = Login::new(128);
        send(
            &mut login,
            "InitiatorName=iqn.i\0TargetName=iqn.t:chap\0AuthMethod=CHAP\0",
        );
        assert_eq!(
            send(&mut login, "CHAP_N=alice\0CHAP_R=0x00\0").0,
            status::MISSING_PARAMETER
        );
        // CHAP keys when AuthMethod=None was agreed.
        let mut login = Login::new(128);
        send(&mut login, "InitiatorName=iqn.i\0TargetName=iqn.t:a\0AuthMethod=None\0");
        assert_eq!(send(&mut login, "CHAP_A=5\0").0, status::INITIATOR_ERROR);
    }

    #[test]
    fn mutual_chap_answers_the_initiators_challenge() {
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:mutual");
        let ours = [7u8; 16];
        let text = format!(
            "CHAP_N=alice\0CHAP_R={}\0CHAP_I=42\0CHAP_C={}\0",
            answer(id, ALICE_SECRET, &challenge),
            chap::encode_hex(&ours)
        );
        let (status, bhs, reply, _) = send(&mut login, &text);
        assert_eq!(status, status::SUCCESS);
        assert_eq!(bhs.0[1] & 0x80, 0x80);
        let reply = keys(&reply);
        assert_eq!(reply["CHAP_N"], "target");
        assert_eq!(reply["CHAP_R"], answer(42, TARGET_SECRET, &ours));
    }

    #[test]
    fn mutual_chap_refuses_reflection_missing_challenge_and_shared_secrets() {
        // The target's own challenge handed back.
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:mutual");
        let text = format!(
            "CHAP_N=alice\0CHAP_R={}\0CHAP_I={id}\0CHAP_C={}\0",
            answer(id, ALICE_SECRET, &challenge),
            chap::encode_hex(&challenge)
        );
        let (status, _, reply, next) = send(&mut login, &text);
        assert_eq!((status, next), (status::AUTHENTICATION_FAILED, Next::Fail));
        assert!(reply.is_empty(), "nothing is answered to a reflected challenge");
        // iscsi.auth=mutual and the initiator does not challenge the target.
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:mutual");
        let text = format!("CHAP_N=alice\0CHAP_R={}\0", answer(id, ALICE_SECRET, &challenge));
        assert_eq!(send(&mut login, &text).0, status::AUTHENTICATION_FAILED);
        // Same secret both ways.
        let (mut login, id, challenge) = chap_until_challenge("iqn.t:same");
        let text = format!(
            "CHAP_N=alice\0CHAP_R={}\0CHAP_I=1\0CHAP_C=0x0102030405060708090a0b0c0d0e0f10\0",
            answer(id, ALICE_SECRET, &challenge)
        );
        assert_eq!(send(&mut login, &text).0, status::AUTHENTICATION_FAILED);
    }

    #[test]
    fn chap_target_refuses_logins_that_skip_authentication() {
        // Straight to operational negotiation.
        let mut login = Login::new(128);
        let (bhs, _, next) = login.step(
            &request(0x87, 1),
            b"InitiatorName=iqn.i\0TargetName=iqn.t:chap\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!((status_of(&bhs), next), (status::AUTHENTICATION_FAILED, Next::Fail));
        // Security stage, transit without any AuthMethod.
        let mut login = Login::new(128);
        let status = send(&mut login, "InitiatorName=iqn.i\0TargetName=iqn.t:chap\0").0;
        assert_eq!(status, status::AUTHENTICATION_FAILED);
        // AuthMethod=None only.
        let mut login = Login::new(128);
        let text = "InitiatorName=iqn.i\0TargetName=iqn.t:chap\0AuthMethod=None\0";
        assert_eq!(send(&mut login, text).0, status::AUTHENTICATION_FAILED);
        // Changing the target name after the first request.
        let (mut login, _, _) = chap_until_challenge("iqn.t:chap");
        assert_eq!(send(&mut login, "TargetName=iqn.t:a\0").0, status::INITIATOR_ERROR);
    }

    #[test]
    fn discovery_needs_no_authentication() {
        let mut login = Login::new(128);
        let text = "InitiatorName=iqn.i\0SessionType=Discovery\0AuthMethod=CHAP,None\0";
        let (status, bhs, reply, _) = send(&mut login, text);
        assert_eq!(status, status::SUCCESS);
        assert_eq!(bhs.0[1] & 0x80, 0x80);
        assert_eq!(keys(&reply)["AuthMethod"], "None");
    }
}
