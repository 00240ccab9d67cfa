//! The login phase (RFC 7143 6.3 and 11.12/11.13) as a state machine over
//! login request PDUs: security negotiation, operational negotiation, then
//! the full feature phase. It does no I/O; the connection feeds it requests
//! and sends what it returns.

use super::pdu::{op, Bhs};
use super::text::{self, Answer, Params, TextError, MAX_TEXT_BYTES, TARGET_MAX_RECV_DATA_SEGMENT};

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
}

const SECURITY: u8 = 0;
const OPERATIONAL: u8 = 1;
const FULL_FEATURE: u8 = 3;
/// Longest iSCSI name (RFC 7143 4.2.7.1: 223 bytes).
const MAX_NAME_BYTES: usize = 223;

/// What the login machine asks of the target: which names exist and who may
/// log in to them.
pub trait Directory {
    fn target_exists(&self, target_name: &str) -> bool;
    fn initiator_allowed(&self, target_name: &str, initiator_name: &str) -> bool;
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
        }
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
        let pairs = match text::parse(&text) {
            Ok(pairs) => pairs,
            Err(TextError::KeyTooLong(_)) | Err(_) => return self.fail(request, status::INITIATOR_ERROR),
        };

        let mut reply: Vec<(String, String)> = Vec::new();
        let mut auth_rejected = false;
        for (key, value) in &pairs {
            match key.as_str() {
                "InitiatorName" => {
                    if value.is_empty() || value.len() > MAX_NAME_BYTES {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    self.initiator_name = Some(value.clone());
                }
                "TargetName" => {
                    if value.len() > MAX_NAME_BYTES {
                        return self.fail(request, status::NOT_FOUND);
                    }
                    self.target_name = Some(value.clone());
                }
                "SessionType" => {
                    self.session_type = match value.as_str() {
                        "Discovery" => SessionType::Discovery,
                        "Normal" => SessionType::Normal,
                        _ => return self.fail(request, status::SESSION_TYPE_NOT_SUPPORTED),
                    }
                }
                "AuthMethod" => {
                    if self.stage != SECURITY {
                        return self.fail(request, status::INITIATOR_ERROR);
                    }
                    if value.split(',').any(|m| m == "None") {
                        reply.push((key.clone(), "None".into()));
                    } else {
                        reply.push((key.clone(), "Reject".into()));
                        auth_rejected = true;
                    }
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
        let Some(initiator_name) = self.initiator_name.clone() else {
            return self.fail(request, status::MISSING_PARAMETER);
        };
        if auth_rejected {
            return self.fail(request, status::AUTHENTICATION_FAILED);
        }
        if self.session_type == SessionType::Normal {
            let Some(target) = self.target_name.clone() else {
                return self.fail(request, status::MISSING_PARAMETER);
            };
            if !directory.target_exists(&target) {
                return self.fail(request, status::NOT_FOUND);
            }
            if !directory.initiator_allowed(&target, &initiator_name) {
                return self.fail(request, status::AUTHORIZATION_FAILED);
            }
            if !self.declared_tpgt {
                self.declared_tpgt = true;
                reply.push(("TargetPortalGroupTag".into(), "1".into()));
            }
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

    struct OneTarget;

    impl Directory for OneTarget {
        fn target_exists(&self, name: &str) -> bool {
            name == "iqn.t:a"
        }
        fn initiator_allowed(&self, _: &str, initiator: &str) -> bool {
            initiator != "iqn.denied"
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
            b"InitiatorName=iqn.denied\0TargetName=iqn.t:a\0",
            &OneTarget,
            &mut || 1,
        );
        assert_eq!(status_of(&bhs), status::AUTHORIZATION_FAILED);
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
}
